# An asyncio (epoll) echo server and client for tests/sockets.rs: the
# client checks every answer, of 1000 to 3999 bytes, and prints "ok TOTAL".
import asyncio, sys
port = int(sys.argv[2])
async def handle(r, w):
    while True:
        d = await r.read(65536)
        if not d:
            break
        w.write(d)
        await w.drain()
    w.close()
async def server():
    s = await asyncio.start_server(handle, '127.0.0.1', port)
    async with s:
        await s.serve_forever()
async def client(n):
    r, w = await asyncio.open_connection('127.0.0.1', port)
    total = 0
    for i in range(n):
        msg = bytes((i * 7 + k) % 256 for k in range(1000 + i % 3000))
        w.write(msg)
        await w.drain()
        got = await r.readexactly(len(msg))
        assert got == msg, i
        total += len(msg)
    w.close()
    print("ok", total)
if sys.argv[1] == 'server':
    asyncio.run(server())
else:
    asyncio.run(client(int(sys.argv[3])))
