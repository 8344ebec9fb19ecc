//! A writer of cpio archives in the "newc" format, the one the Linux
//! kernel unpacks as an initramfs.
//!
//! Written here rather than run through `cpio -o` so that the archive's
//! contents (modes, owners, device nodes, symlinks, timestamps) come from
//! the image description alone: two builds of the same inputs give the
//! same bytes, and `/dev/console` can be a device node without creating
//! one on the host. Format: each entry is a 110-byte ASCII header
//! (`070701` then 13 fields of 8 hex digits), the NUL-terminated name
//! padded to 4 bytes, the data padded to 4 bytes; the archive ends with
//! an entry named `TRAILER!!!`.

use std::io::{self, Read, Write};

const MAGIC: &[u8; 6] = b"070701";
const HEADER_LEN: usize = 110;
const TRAILER: &str = "TRAILER!!!";

/// File type bits of an entry's mode.
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFCHR: u32 = 0o020000;

/// Writes a newc archive to `W`. Every entry is owned by root, with
/// mtime 0 and a fresh inode number.
pub struct Writer<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

/// One entry's header fields that vary.
struct Header<'a> {
    name: &'a str,
    mode: u32,
    nlink: u32,
    size: u64,
    rdev: (u32, u32),
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Writer<W> {
        Writer { out, written: 0, next_ino: 1 }
    }

    /// A directory. `path` is relative to the root (no leading `/`).
    pub fn dir(&mut self, path: &str, perm: u32) -> io::Result<()> {
        self.header(Header { name: path, mode: S_IFDIR | perm, nlink: 2, size: 0, rdev: (0, 0) })
    }

    /// A regular file with these contents.
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.file_from(path, perm, data.len() as u64, data)
    }

    /// A regular file of `len` bytes read from `data`, which must yield
    /// exactly that many.
    pub fn file_from(&mut self, path: &str, perm: u32, len: u64, data: impl Read) -> io::Result<()> {
        self.header(Header { name: path, mode: S_IFREG | perm, nlink: 1, size: len, rdev: (0, 0) })?;
        let copied = io::copy(&mut data.take(len), &mut self.out)?;
        if copied != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{path}: {copied} bytes where {len} were announced"),
            ));
        }
        self.written += len;
        self.pad()
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        let size = target.len() as u64;
        self.header(Header { name: path, mode: S_IFLNK | 0o777, nlink: 1, size, rdev: (0, 0) })?;
        self.raw(target.as_bytes())?;
        self.pad()
    }

    /// A character device node.
    pub fn char_device(&mut self, path: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.header(Header { name: path, mode: S_IFCHR | perm, nlink: 1, size: 0, rdev: (major, minor) })
    }

    /// Writes the trailer and returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.header(Header { name: TRAILER, mode: 0, nlink: 1, size: 0, rdev: (0, 0) })?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn header(&mut self, h: Header<'_>) -> io::Result<()> {
        if h.name.is_empty() || h.name.starts_with('/') || h.name.contains('\0') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad cpio name {:?}", h.name)));
        }
        let size = u32::try_from(h.size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: over 4 GiB", h.name)))?;
        let ino = self.next_ino;
        self.next_ino += 1;
        let fields = [
            ino,
            h.mode,
            0, // uid
            0, // gid
            h.nlink,
            0, // mtime
            size,
            0, // devmajor
            0, // devminor
            h.rdev.0,
            h.rdev.1,
            h.name.len() as u32 + 1,
            0, // check
        ];
        let mut head = Vec::with_capacity(HEADER_LEN + h.name.len() + 4);
        head.extend_from_slice(MAGIC);
        for f in fields {
            head.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        debug_assert_eq!(head.len(), HEADER_LEN);
        head.extend_from_slice(h.name.as_bytes());
        head.push(0);
        self.raw(&head)?;
        self.pad()
    }

    fn raw(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    /// Pads what was written so far to a multiple of 4 bytes.
    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.raw(&[0u8; 3][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One parsed entry: name, mode, rdev, data.
    type Entry = (String, u32, (u32, u32), Vec<u8>);

    /// Reads a newc archive back, checking magic and alignment.
    fn parse(mut b: &[u8]) -> Vec<Entry> {
        let mut out = Vec::new();
        let total = b.len();
        for _ in 0..1000 {
            assert_eq!((total - b.len()) % 4, 0, "entry not 4-aligned");
            assert_eq!(&b[..6], MAGIC);
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&b[6 + 8 * i..14 + 8 * i]).unwrap(), 16).unwrap()
            };
            let (mode, size, rdev, namesize) =
                (field(1), field(6) as usize, (field(9), field(10)), field(11) as usize);
            let name = std::str::from_utf8(&b[HEADER_LEN..HEADER_LEN + namesize - 1]).unwrap().to_string();
            assert_eq!(b[HEADER_LEN + namesize - 1], 0);
            let data_at = (HEADER_LEN + namesize).next_multiple_of(4);
            let data = b[data_at..data_at + size].to_vec();
            b = &b[(data_at + size).next_multiple_of(4)..];
            if name == TRAILER {
                assert!(b.is_empty(), "{} bytes after the trailer", b.len());
                return out;
            }
            out.push((name, mode, rdev, data));
        }
        panic!("no trailer in 1000 entries");
    }

    #[test]
    fn entries_read_back_aligned_with_their_kinds() {
        let mut w = Writer::new(Vec::new());
        w.dir("bin", 0o755).unwrap();
        w.file("bin/x", 0o755, b"hello").unwrap();
        w.file("e", 0o644, b"").unwrap();
        w.symlink("bin/sh", "busybox").unwrap();
        w.char_device("dev/console", 0o600, 5, 1).unwrap();
        let b = w.finish().unwrap();
        let e = parse(&b);
        assert_eq!(e.len(), 5);
        assert_eq!(e[0].0, "bin");
        assert_eq!(e[0].1, S_IFDIR | 0o755);
        assert_eq!((e[1].0.as_str(), e[1].1, e[1].3.as_slice()), ("bin/x", S_IFREG | 0o755, &b"hello"[..]));
        assert!(e[2].3.is_empty());
        assert_eq!((e[3].1, e[3].3.as_slice()), (S_IFLNK | 0o777, &b"busybox"[..]));
        assert_eq!((e[4].1, e[4].2), (S_IFCHR | 0o600, (5, 1)));
    }

    #[test]
    fn bad_names_and_short_readers_are_refused() {
        let mut w = Writer::new(Vec::new());
        assert!(w.dir("/abs", 0o755).is_err());
        assert!(w.dir("", 0o755).is_err());
        assert!(w.file_from("f", 0o644, 10, &b"short"[..]).is_err());
    }
}
