//! Opening and reading files of a model directory, which is untrusted input.
//!
//! Only regular files are read: a FIFO would block the load forever and a device
//! such as `/dev/zero` would be read until memory runs out. The file is opened
//! with `O_NONBLOCK` (so opening a FIFO returns at once) and then the *opened
//! handle* is checked, so a file swapped between a check and the open is still
//! caught. Symlinks are followed (Hugging Face caches are made of them) and their
//! target is checked like any file. Reads stop at a cap per kind of file, through
//! `Read::take`, so a file that grows or lies about its size stays bounded.

use crate::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// `config.json`, `generation_config.json`, `tokenizer_config.json`,
/// `chat_template.json`: a few KiB in practice (chat templates embedded).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// `chat_template.jinja`.
pub const MAX_TEMPLATE_BYTES: u64 = 4 << 20;
/// Text inputs named on the command line (prompts, perplexity and calibration text).
pub const MAX_INPUT_TEXT_BYTES: u64 = 1 << 30;
/// `tokenizer.json`: ~17 MB for 256k-token vocabularies (Gemma), 11 MB for Qwen.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Opens `path` for reading and checks that it is a regular file. A missing file
/// is an `Io` error whose message names the path.
pub fn open(path: &Path) -> Result<File> {
    open_inner(path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))
        .and_then(|file| {
            let meta = file
                .metadata()
                .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?;
            if !meta.file_type().is_file() {
                return Err(Error::invalid_model(format!(
                    "{} is not a regular file ({}); only regular files are read",
                    path.display(),
                    describe_type(&meta.file_type())
                )));
            }
            Ok(file)
        })
}

#[cfg(unix)]
fn open_inner(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: opening a FIFO with no writer would otherwise wait for one. It
    // has no effect on reads of regular files, the only ones read after the check.
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

#[cfg(not(unix))]
fn open_inner(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

fn describe_type(ft: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else {
        "not a plain file"
    }
}

/// Reads all of a regular file of at most `cap` bytes.
pub fn read(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let file = open(path)?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size > cap {
        return Err(too_big(path, cap));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    if bytes.len() as u64 > cap {
        return Err(too_big(path, cap));
    }
    Ok(bytes)
}

/// Reads a regular UTF-8 text file of at most `cap` bytes.
pub fn read_text(path: &Path, cap: u64) -> Result<String> {
    String::from_utf8(read(path, cap)?)
        .map_err(|_| Error::invalid_model(format!("{} is not valid UTF-8", path.display())))
}

/// Like [`read_text`], but a missing file is `Ok(None)`.
pub fn read_text_if_exists(path: &Path, cap: u64) -> Result<Option<String>> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => read_text(path, cap).map(Some),
    }
}

fn too_big(path: &Path, cap: u64) -> Error {
    Error::invalid_model(format!(
        "{} is larger than the limit of {cap} bytes for this file",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_and_big_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("ni-untrusted-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = read(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(err.message.contains("/dev/zero") && err.message.contains("character device"));
        let fifo = dir.join("fifo.json");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: c is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read(&fifo, 1 << 20).unwrap_err();
        assert!(err.message.contains("FIFO"), "{}", err.message);
        let big = dir.join("big.json");
        std::fs::write(&big, vec![b' '; 2000]).unwrap();
        let err = read(&big, 1000).unwrap_err();
        assert!(err.message.contains("big.json") && err.message.contains("1000 bytes"));
        assert_eq!(read(&big, 2000).unwrap().len(), 2000);
        assert!(read_text_if_exists(&dir.join("missing"), 10)
            .unwrap()
            .is_none());
        let err = read_text(&dir, 10).unwrap_err();
        assert!(err.message.contains("directory"), "{}", err.message);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
