//! `nanoinfer serve`: runs the HTTP server, a separate binary
//! (`nanoinfer-serve`, the `server/` crate) so that this CLI and the
//! embeddable library stay free of the server's dependencies. It is looked
//! up next to this executable, as git and cargo find their subcommands.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

const SERVER_BINARY: &str = "nanoinfer-serve";

/// Replaces this process with the server, passing the arguments on.
pub fn exec(args: &[String]) -> Result<(), String> {
    let server = server_path()?;
    let err = Command::new(&server).args(args).exec();
    Err(format!("cannot run {}: {err}", server.display()))
}

fn server_path() -> Result<PathBuf, String> {
    let me = std::env::current_exe().map_err(|e| format!("cannot locate this executable: {e}"))?;
    let beside = me.with_file_name(SERVER_BINARY);
    if beside.is_file() {
        return Ok(beside);
    }
    Err(format!(
        "`{SERVER_BINARY}` is not next to {} (build it: cargo build --release -p nanoinfer-server)",
        me.display()
    ))
}
