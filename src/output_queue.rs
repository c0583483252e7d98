//! The queue between the control channel and a process's stdout or stderr reader.
//!
//! The guest decides how it cuts its output into chunks. Flow control bounds the *bytes* that
//! wait here (one window per stream), but a queue of chunks would also hold one item per chunk:
//! a forged guest cutting its window into 1-byte chunks would make a million items. This queue
//! appends a chunk to the last one waiting while that one is small, so what waits is at most
//! about the bytes the window allows plus [`COALESCE_BELOW`] per item, whatever the chunking.
//!
//! Hand-written rather than `tokio::sync::mpsc` because no channel of tokio's can merge into an
//! item already queued; the rest (one sender, one receiver, wake on send or close) is the small
//! part of a channel this needs. Generic over what it carries ([`Mergeable`]), so it depends on
//! nothing of the control channel.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// What the queue carries: items that can take a later item's bytes into themselves.
pub(crate) trait Mergeable: Sized {
    /// This item's size, for the merge threshold; `None` for an item that never merges.
    fn merge_len(&self) -> Option<usize>;
    /// Appends `later` to `self` if both merge; otherwise gives `later` back.
    fn merge(&mut self, later: Self) -> Result<(), Self>;
}

/// A waiting chunk smaller than this takes the next chunk's bytes instead of a new item.
pub(crate) const COALESCE_BELOW: usize = 64 * 1024;

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    sender_gone: bool,
    receiver_gone: bool,
    waker: Option<Waker>,
}

/// Why [`OutputReceiver::try_recv`] returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TryRecvError {
    /// Nothing waits now; more may come.
    Empty,
    /// Nothing waits and the sender is gone.
    Disconnected,
}

/// The control channel's end.
#[derive(Debug)]
pub(crate) struct OutputSender<T>(Arc<Mutex<State<T>>>);

/// The reader's end.
#[derive(Debug)]
pub(crate) struct OutputReceiver<T>(Arc<Mutex<State<T>>>);

/// A new queue.
pub(crate) fn output_queue<T: Mergeable>() -> (OutputSender<T>, OutputReceiver<T>) {
    let state = Arc::new(Mutex::new(State {
        items: VecDeque::new(),
        sender_gone: false,
        receiver_gone: false,
        waker: None,
    }));
    (OutputSender(state.clone()), OutputReceiver(state))
}

fn lock<T>(state: &Mutex<State<T>>) -> std::sync::MutexGuard<'_, State<T>> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: Mergeable> OutputSender<T> {
    /// Queues `item`, merging data into a small chunk already waiting. Gives the item back if
    /// the receiver is gone.
    pub(crate) fn send(&self, item: T) -> Result<(), T> {
        let mut state = lock(&self.0);
        if state.receiver_gone {
            return Err(item);
        }
        let unmerged = match state.items.back_mut() {
            Some(last) if last.merge_len().is_some_and(|n| n < COALESCE_BELOW) => {
                last.merge(item).err()
            }
            _ => Some(item),
        };
        if let Some(item) = unmerged {
            state.items.push_back(item);
        }
        if let Some(waker) = state.waker.take() {
            waker.wake();
        }
        Ok(())
    }
}

impl<T> Drop for OutputSender<T> {
    fn drop(&mut self) {
        let mut state = lock(&self.0);
        state.sender_gone = true;
        if let Some(waker) = state.waker.take() {
            waker.wake();
        }
    }
}

impl<T: Mergeable> OutputReceiver<T> {
    /// The next item; `None` once the sender is gone and everything was received.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = lock(&self.0);
        if let Some(item) = state.items.pop_front() {
            return Poll::Ready(Some(item));
        }
        if state.sender_gone {
            return Poll::Ready(None);
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// The next item; `None` once the sender is gone and everything was received.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// The next item if one waits.
    pub(crate) fn try_recv(&mut self) -> Result<T, TryRecvError> {
        let mut state = lock(&self.0);
        match state.items.pop_front() {
            Some(item) => Ok(item),
            None if state.sender_gone => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Refuses further items (the sender's `send` gives them back); items already queued can
    /// still be received.
    pub(crate) fn close(&mut self) {
        lock(&self.0).receiver_gone = true;
    }

    /// The items waiting now and their merged size (for tests and bounds checks).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn queued(&self) -> (usize, usize) {
        let state = lock(&self.0);
        let bytes = state.items.iter().filter_map(Mergeable::merge_len).sum();
        (state.items.len(), bytes)
    }
}

impl<T> Drop for OutputReceiver<T> {
    fn drop(&mut self) {
        lock(&self.0).receiver_gone = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::OutputItem;

    #[test]
    fn a_window_cut_into_one_byte_chunks_is_a_handful_of_items() {
        let (tx, rx) = output_queue();
        let window = crate::protocol::OUTPUT_WINDOW as usize;
        for i in 0..window {
            tx.send(OutputItem::Data(vec![i as u8])).unwrap();
        }
        let (items, bytes) = rx.queued();
        assert_eq!(bytes, window);
        assert!(items <= window / COALESCE_BELOW + 1, "{items} items");
    }

    #[tokio::test]
    async fn bytes_arrive_in_order_and_the_end_after_them() {
        let (tx, mut rx) = output_queue();
        tx.send(OutputItem::Data(b"ab".to_vec())).unwrap();
        tx.send(OutputItem::Data(vec![7u8; COALESCE_BELOW]))
            .unwrap();
        tx.send(OutputItem::Data(b"cd".to_vec())).unwrap();
        drop(tx);
        let mut all = Vec::new();
        while let Some(item) = rx.recv().await {
            match item {
                OutputItem::Data(d) => all.extend(d),
                OutputItem::Broken(_) => panic!("no break was sent"),
            }
        }
        assert_eq!(&all[..2], b"ab");
        assert_eq!(&all[all.len() - 2..], b"cd");
        assert_eq!(all.len(), COALESCE_BELOW + 4);
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Disconnected);
    }

    #[tokio::test]
    async fn a_waiting_reader_wakes_on_send_and_a_closed_one_refuses() {
        let (tx, mut rx) = output_queue();
        let reader = tokio::spawn(async move {
            let item = std::future::poll_fn(|cx| rx.poll_recv(cx)).await;
            (item.is_some(), rx)
        });
        tokio::task::yield_now().await;
        tx.send(OutputItem::Data(b"x".to_vec())).unwrap();
        let (got, mut rx) = reader.await.unwrap();
        assert!(got);
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
        rx.close();
        assert!(tx.send(OutputItem::Data(b"y".to_vec())).is_err());
    }
}
