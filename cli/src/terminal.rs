//! The host terminal of `krunbox run -t`: raw mode while the guest has it, and its size.

/// Puts the host terminal in raw mode for the life of the guard (keystrokes such as Ctrl-C go
/// to the guest's terminal, not to krunbox), restoring it on drop.
pub(crate) struct RawTerminal {
    saved: Option<nix::sys::termios::Termios>,
}

impl RawTerminal {
    pub(crate) fn enter() -> RawTerminal {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let Ok(saved) = tcgetattr(&stdin) else {
            return RawTerminal { saved: None };
        };
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        let _ = tcsetattr(&stdin, SetArg::TCSANOW, &raw);
        RawTerminal { saved: Some(saved) }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin(),
                nix::sys::termios::SetArg::TCSANOW,
                saved,
            );
        }
    }
}

/// This terminal's size (rows, columns), if stdin or stdout is a terminal.
pub(crate) fn terminal_size() -> Option<(u16, u16)> {
    for fd in [libc::STDIN_FILENO, libc::STDOUT_FILENO] {
        // SAFETY: TIOCGWINSZ writes a winsize into a valid, zeroed struct.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_row > 0 {
            return Some((ws.ws_row, ws.ws_col));
        }
    }
    None
}
