//! A connection's socket as the API's slots see it: each write that finds
//! the socket full starts the connection's stall, each that goes through
//! ends it (`conns::Stall`), so the sweep can drop a client that stopped
//! reading its response or its stream.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::conns::{Slots, Stall};

pub struct Watched<S> {
    inner: S,
    stall: Arc<Stall>,
    slots: Arc<Slots>,
}

impl<S> Watched<S> {
    pub fn new(inner: S, stall: Arc<Stall>, slots: Arc<Slots>) -> Self {
        Self {
            inner,
            stall,
            slots,
        }
    }

    fn note<T>(&self, p: Poll<T>) -> Poll<T> {
        match p {
            Poll::Pending => self.stall.waiting(self.slots.ms(Instant::now())),
            Poll::Ready(_) => self.stall.flowing(),
        }
        p
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let p = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(p)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let p = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note(p)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let p = Pin::new(&mut self.inner).poll_flush(cx);
        self.note(p)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
