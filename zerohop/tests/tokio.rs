//! The async endpoint on a tokio runtime, over TCP on loopback.

use std::time::Duration;

use futures_util::StreamExt;
use zerohop::tokio::AsyncEndpoint;
use zerohop::{Config, Endpoint, Event, Kind};

fn tcp() -> Endpoint {
    let mut c = Config::only(Kind::Tcp);
    c.pool_bytes = 128 << 20;
    Endpoint::open(c).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_that_must_wait_for_credit_finish_once_the_receiver_reads() {
    let server = AsyncEndpoint::new(tcp());
    let addr = server.endpoint().listen("127.0.0.1:0").unwrap();
    let client = AsyncEndpoint::new(tcp());
    let peer = client.connect(addr, Duration::from_secs(5)).await.unwrap();
    // 160 MiB while nobody reads: past the window, the socket buffers, the
    // receiver's inbox and its async queue, so some sends wait (on the
    // blocking pool).
    let sender = tokio::spawn(async move {
        for i in 0..160u32 {
            let mut m = vec![i as u8; 1 << 20];
            m[..4].copy_from_slice(&i.to_le_bytes());
            client.send(peer, &m).await.unwrap();
        }
        client
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !sender.is_finished(),
        "160 MiB cannot all be in flight unread"
    );
    let mut events = server.events().await;
    let mut next = 0u32;
    while next < 160 {
        match events.next().await.unwrap().unwrap() {
            Event::Message(m) => {
                let b = m.bytes().unwrap();
                assert_eq!(b.len(), 1 << 20);
                assert_eq!(u32::from_le_bytes(b[..4].try_into().unwrap()), next);
                assert!(b[4..].iter().all(|&x| x == next as u8));
                next += 1;
            }
            Event::Connected { .. } => {}
            e => panic!("unexpected {e:?}"),
        }
    }
    let client = sender.await.unwrap();
    let stats = client.endpoint().stats(peer).unwrap();
    assert_eq!(stats.messages_sent, 160);
    assert!(
        stats.credit_stalls > 0,
        "the sender waited for credit: {stats:?}"
    );
    assert_eq!(stats.errors, 0, "waiting for room is no error: {stats:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn recv_and_a_peers_end_on_a_single_threaded_runtime() {
    let server = AsyncEndpoint::new(tcp());
    let addr = server.endpoint().listen("127.0.0.1:0").unwrap();
    let client = AsyncEndpoint::new(tcp());
    let peer = client.connect(addr, Duration::from_secs(5)).await.unwrap();
    client.send(peer, b"one").await.unwrap();
    let m = server.recv().await.unwrap();
    assert_eq!(m.bytes(), Some(&b"one"[..]));
    let from = m.peer();
    server.send(from, b"two").await.unwrap();
    assert_eq!(client.recv().await.unwrap().bytes(), Some(&b"two"[..]));
    client.endpoint().close(Duration::from_secs(5)).unwrap();
    let e = server.recv().await.unwrap_err();
    assert_eq!(e.peer(), Some(from));
    assert!(e.to_string().contains("closed cleanly"), "{e}");
}
