//! A future that runs to its end even when its caller gives up on it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future polled in place (no task of its own: a spawn per write cost
/// 15% of a mirror's 4K writes), and, if dropped before its end, run to
/// its end in a task of its own. For what must not stop half-way when its
/// caller drops it (a timeout, Ctrl-C): a write whose place in the order
/// of overlapping writes, or whose regions' locks, must be kept until its
/// every request is answered.
pub(crate) struct RunsToEnd<F: Future + Send + 'static>(Option<Pin<Box<F>>>)
where
    F::Output: Send;

impl<F: Future + Send + 'static> RunsToEnd<F>
where
    F::Output: Send,
{
    pub(crate) fn new(f: F) -> Self {
        RunsToEnd(Some(Box::pin(f)))
    }
}

impl<F: Future + Send + 'static> Future for RunsToEnd<F>
where
    F::Output: Send,
{
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let f = this.0.as_mut().expect("polled after its end");
        let r = f.as_mut().poll(cx);
        if r.is_ready() {
            this.0 = None;
        }
        r
    }
}

impl<F: Future + Send + 'static> Drop for RunsToEnd<F>
where
    F::Output: Send,
{
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            // Without a runtime (it is shutting down) the future is dropped:
            // its own guards say what it leaves undone.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(f);
            }
        }
    }
}
