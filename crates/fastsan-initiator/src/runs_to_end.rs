//! A future that runs to its end even when its caller gives up on it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future polled in place (no task of its own: a spawn per write cost
/// 15% of a mirror's 4K writes), and, if dropped after it started and
/// before its end, run to its end in a task of its own. For what must not
/// stop half-way when its caller drops it (a timeout, Ctrl-C): a mirror's
/// write, whose regions' locks must be kept until every leg has answered.
/// (A BRP session's write needs less: its drop guard keeps its place in
/// the order of overlapping writes, `session.rs`.) One dropped
/// before its first poll never started: it is dropped too (run later, it
/// would take its place behind writes its caller issued after giving it up).
pub(crate) struct RunsToEnd<F: Future + Send + 'static>
where
    F::Output: Send,
{
    f: Option<Pin<Box<F>>>,
    started: bool,
}

impl<F: Future + Send + 'static> RunsToEnd<F>
where
    F::Output: Send,
{
    pub(crate) fn new(f: F) -> Self {
        RunsToEnd { f: Some(Box::pin(f)), started: false }
    }
}

impl<F: Future + Send + 'static> Future for RunsToEnd<F>
where
    F::Output: Send,
{
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.started = true;
        let f = this.f.as_mut().expect("polled after its end");
        let r = f.as_mut().poll(cx);
        if r.is_ready() {
            this.f = None;
        }
        r
    }
}

impl<F: Future + Send + 'static> Drop for RunsToEnd<F>
where
    F::Output: Send,
{
    fn drop(&mut self) {
        if let Some(f) = self.f.take().filter(|_| self.started) {
            // Without a runtime (it is shutting down) the future is dropped:
            // its own guards say what it leaves undone.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(f);
            }
        }
    }
}
