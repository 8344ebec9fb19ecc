// tests written next
