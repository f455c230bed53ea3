//! Reading the files a configuration names (the configuration itself, its
//! TLS files, keys, CA and password files), at start and on every reload:
//! regular files only, of a bounded size, opened without blocking. A FIFO or
//! a device named by mistake (or by someone who can write where the files
//! live) is an error at once, never a reload that waits for ever; a file
//! that grows without end (`/dev/zero` behind a symlink) is refused by its
//! size, not read into memory.

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The longest configuration file read.
pub const CONFIG_FILE_LIMIT: u64 = 16 << 20;
/// The longest certificate, key, CA or password file read.
pub const SMALL_FILE_LIMIT: u64 = 1 << 20;

/// The bytes of the regular file at `path` (symlinks followed), at most `limit`.
pub fn read_regular(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    // Without O_NONBLOCK, opening a FIFO waits for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::IsADirectory,
            "a directory, not a file",
        ));
    }
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, a socket or a device)",
        ));
    }
    let too_long = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("longer than {limit} bytes"),
        )
    };
    if meta.len() > limit {
        return Err(too_long());
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_long());
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_text(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, limit)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifos_devices_directories_and_long_files_are_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        // Would block for ever on a plain open or read: an error at once.
        assert_eq!(
            read_regular(&fifo, 100).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            read_regular(Path::new("/dev/zero"), 100)
                .unwrap_err()
                .kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            read_regular(dir.path(), 100).unwrap_err().kind(),
            io::ErrorKind::IsADirectory
        );
        let long = dir.path().join("long");
        std::fs::write(&long, [b'x'; 101]).unwrap();
        assert_eq!(
            read_regular(&long, 100).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert_eq!(read_regular(&long, 101).unwrap().len(), 101);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&long, &link).unwrap();
        assert_eq!(
            read_regular(&link, 101).unwrap().len(),
            101,
            "symlinks are followed"
        );
        assert_eq!(
            read_regular(&dir.path().join("missing"), 100)
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
    }
}
