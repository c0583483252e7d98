//! A plain-HTTP origin on 127.0.0.1 for the network tests: HTTP/1.0 style, one request a
//! connection, every request's head kept for the test to read.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Starts an origin on 127.0.0.1 (a free port): reads each request's head, keeps it, answers
/// and closes. `/big/N` gets N bytes of [`pattern`]; any other path a line, `origin says
/// <path>`. Returns its port and the heads kept, in arrival order.
pub async fn start() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let kept = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
                    if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let path = head.split(' ').nth(1).unwrap_or("?").to_owned();
                kept.lock().unwrap().push(head);
                let body = match path.strip_prefix("/big/").and_then(|n| n.parse().ok()) {
                    Some(n) => pattern(n),
                    None => format!("origin says {path}\n").into_bytes(),
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&body).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    (port, heads)
}

/// `n` bytes that are not all alike (so a lost, repeated or reordered chunk shows).
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}
