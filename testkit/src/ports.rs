//! Ports for test servers.
//!
//! Binding `127.0.0.1:0`, reading the port and releasing it races: until the server binds it,
//! the kernel may hand the same port to any outgoing connection or to another `bind(0)`, and
//! tests open thousands of connections. So ports come from below Linux's default ephemeral
//! range (`net.ipv4.ip_local_port_range`, 32768–60999), where the kernel never picks one by
//! itself, and are handed out in turn by a counter that every test process shares (a file in
//! the temporary directory, changed under an exclusive lock), so two tests never get the same
//! port while a run lasts.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::TcpListener;

/// The ports handed out: `FIRST .. FIRST + COUNT`, all below the ephemeral range.
const FIRST: u16 = 20_000;
const COUNT: u16 = 12_000;

/// A port nothing listens on, that no other test is given until `COUNT` more ports were.
pub fn free_port() -> u16 {
    let path = std::env::temp_dir().join("portcullis-test-ports");
    let mut counter = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .unwrap_or_else(|error| panic!("opening {}: {error}", path.display()));
    counter
        .lock()
        .unwrap_or_else(|error| panic!("locking {}: {error}", path.display()));
    take_port(&mut counter).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// The next port after the one `counter` names that nothing listens on; the counter moves past
/// it. The caller holds the counter's lock.
fn take_port(counter: &mut File) -> std::io::Result<u16> {
    let mut next = read_counter(counter) % COUNT;
    for _ in 0..COUNT {
        let port = FIRST + next;
        next = (next + 1) % COUNT;
        // Skips a port something else on the machine listens on.
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            write_counter(counter, next)?;
            return Ok(port);
        }
    }
    Err(std::io::Error::other(format!(
        "no free port in 127.0.0.1:{FIRST}..{}",
        FIRST + COUNT
    )))
}

/// The stored counter; an empty or garbled file (a first run) counts from zero.
fn read_counter(file: &mut File) -> u16 {
    let mut text = String::new();
    if file.seek(SeekFrom::Start(0)).is_err() {
        return 0;
    }
    match file.read_to_string(&mut text) {
        Ok(_) => text.trim().parse().unwrap_or(0),
        Err(_) => 0,
    }
}

fn write_counter(file: &mut File, next: u16) -> std::io::Result<()> {
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    write!(file, "{next}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_in_turn_from_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            ports.len(),
            "a port was handed out twice: {ports:?}"
        );
        assert!(ports.iter().all(|port| (FIRST..FIRST + COUNT).contains(port)));
    }

    #[test]
    fn a_port_something_listens_on_is_skipped() {
        let taken = free_port();
        let _listener = TcpListener::bind(("127.0.0.1", taken)).expect("bind the port just handed out");
        // A counter of this test's own, pointing at the taken port (as after a wrap).
        let path = std::env::temp_dir().join(format!("portcullis-test-ports-{}", std::process::id()));
        let mut counter = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        write_counter(&mut counter, taken - FIRST).unwrap();
        let next = take_port(&mut counter).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_ne!(next, taken);
        assert!((FIRST..FIRST + COUNT).contains(&next));
    }
}
