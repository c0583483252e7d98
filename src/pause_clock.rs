//! Whether an instance's VM is paused, for how long it has been in all, and deadlines on the
//! guest that stand still while it is: a request or a command's backstop must not expire
//! because the caller paused the VM (docs/architecture.md, "Pause and resume").

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// An instance's pauses: now, and in total.
#[derive(Debug)]
pub(crate) struct PauseClock {
    /// When the current pause began, and the total of the pauses before it.
    state: Mutex<(Option<Instant>, Duration)>,
    /// Whether paused; watched by deadlines waiting for a resume.
    paused: watch::Sender<bool>,
}

impl Default for PauseClock {
    fn default() -> Self {
        PauseClock {
            state: Mutex::new((None, Duration::ZERO)),
            paused: watch::Sender::new(false),
        }
    }
}

impl PauseClock {
    /// Marks the VM paused or running again.
    pub(crate) fn set(&self, paused: bool) {
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match (state.0, paused) {
                (None, true) => state.0 = Some(Instant::now()),
                (Some(since), false) => *state = (None, state.1 + since.elapsed()),
                _ => {}
            }
        }
        self.paused.send_replace(paused);
    }

    pub(crate) fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// How long the VM has been paused in all, the current pause included.
    pub(crate) fn total(&self) -> Duration {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.1 + state.0.map_or(Duration::ZERO, |since| since.elapsed())
    }
}

/// A moment `after` from now in the guest's running time: it moves later by every pause that
/// happens before it comes, and does not come while the VM is paused.
#[derive(Debug, Clone)]
pub(crate) struct GuestDeadline {
    clock: Arc<PauseClock>,
    at: Instant,
    /// The clock's total when the deadline was set: only later pauses move it.
    paused_before: Duration,
}

impl GuestDeadline {
    pub(crate) fn after(clock: &Arc<PauseClock>, after: Duration) -> GuestDeadline {
        GuestDeadline {
            clock: clock.clone(),
            at: Instant::now() + after,
            paused_before: clock.total(),
        }
    }

    /// The same deadline, `later` after it.
    pub(crate) fn later_by(&self, later: Duration) -> GuestDeadline {
        GuestDeadline {
            at: self.at + later,
            ..self.clone()
        }
    }

    /// Completes once the deadline has passed with the VM running.
    pub(crate) async fn elapsed(self) {
        let mut paused = self.clock.paused.subscribe();
        loop {
            if *paused.borrow_and_update() {
                // The clock's owner keeps the sender: an error cannot happen, but would mean
                // no resume is coming either.
                if paused.changed().await.is_err() {
                    return;
                }
                continue;
            }
            let end = self.at + self.clock.total().saturating_sub(self.paused_before);
            if Instant::now() >= end {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(end) => {}
                changed = paused.changed() => if changed.is_err() { return },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_deadline_stands_still_while_paused_and_moves_by_the_pauses_after_it() {
        let clock = Arc::new(PauseClock::default());
        // A pause before the deadline was set does not move it.
        clock.set(true);
        tokio::time::sleep(Duration::from_secs(100)).await;
        clock.set(false);
        let start = Instant::now();
        let deadline = GuestDeadline::after(&clock, Duration::from_secs(10));
        let waiting = tokio::spawn(deadline.clone().elapsed());
        tokio::time::sleep(Duration::from_secs(4)).await;
        clock.set(true);
        // Paused across the original moment: it does not come.
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(!waiting.is_finished(), "came while paused");
        clock.set(false);
        // It comes 6 s of running time later: 10 s of running in all.
        tokio::time::sleep(Duration::from_millis(5_900)).await;
        assert!(!waiting.is_finished(), "came early");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(waiting.is_finished(), "did not come");
        assert_eq!(start.elapsed().as_secs(), 40);
        assert_eq!(clock.total(), Duration::from_secs(130));
        // A deadline never paused is an ordinary one; later_by adds to it.
        let start = Instant::now();
        GuestDeadline::after(&clock, Duration::from_secs(3))
            .later_by(Duration::from_secs(2))
            .elapsed()
            .await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }
}
