//! The background sender: one thread POSTs the queued bodies in order, each try bounded by
//! `notify.timeout_s`, a failed one tried again `notify.retries` times with backoff. Training
//! only ever puts a body on the queue (never waits on the network); a queue past
//! [`MAX_QUEUED`] drops what comes next. A notification that could not be sent is a warning,
//! said once for the run. Not what a body says (`payload.rs`) or when one is sent (`mod.rs`).
use crate::config::notify::WebhookUrl;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Bodies waiting at most: a hook that never answers holds the queue, and a run that sends on
/// every checkpoint must not grow it without end.
pub const MAX_QUEUED: usize = 100;

pub(super) enum Message {
    Send(Value),
    /// Answered once everything queued before it is sent or given up on.
    Flush(mpsc::Sender<()>),
}

/// The queue's end that training holds.
pub(super) struct Queue {
    tx: mpsc::Sender<Message>,
    queued: Arc<AtomicUsize>,
    dropped_said: AtomicBool,
}

impl Queue {
    /// Starts the sender thread for `url`.
    pub(super) fn start(url: WebhookUrl, timeout: Duration, retries: u32) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let count = queued.clone();
        std::thread::Builder::new()
            .name("notify".into())
            .spawn(move || send_all(rx, &url, timeout, retries, &count))?;
        Ok(Self { tx, queued, dropped_said: AtomicBool::new(false) })
    }

    /// Queues `body`; never blocks.
    pub(super) fn push(&self, body: Value) {
        if self.queued.load(Ordering::Relaxed) >= MAX_QUEUED {
            if !self.dropped_said.swap(true, Ordering::Relaxed) {
                tracing::warn!("notify: {MAX_QUEUED} notifications wait to be sent; later ones are dropped");
            }
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Message::Send(body)).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Waits at most `wait` for everything queued to be sent (or given up on).
    pub(super) fn flush(&self, wait: Duration) -> bool {
        let (reply, answered) = mpsc::channel();
        self.tx.send(Message::Flush(reply)).is_ok() && answered.recv_timeout(wait).is_ok()
    }
}

fn send_all(
    rx: mpsc::Receiver<Message>,
    url: &WebhookUrl,
    timeout: Duration,
    retries: u32,
    queued: &AtomicUsize,
) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        // A redirected POST would arrive as a GET elsewhere: a hook that moved is a failure.
        .max_redirects(0)
        .build()
        .into();
    let mut failure_said = false;
    for message in rx {
        match message {
            Message::Send(body) => {
                let sent = deliver(&agent, url, &body.to_string(), retries);
                queued.fetch_sub(1, Ordering::Relaxed);
                if let (Err(why), false) = (sent, failure_said) {
                    failure_said = true;
                    tracing::warn!(
                        "notify: cannot send to {url}: {}; notifications may not arrive (said once), training goes on",
                        url.scrub(&why)
                    );
                }
            }
            Message::Flush(reply) => {
                let _ = reply.send(());
            }
        }
    }
}

/// POSTs `body`, trying again after a failure that may pass (no answer, 429, 5xx).
fn deliver(agent: &ureq::Agent, url: &WebhookUrl, body: &str, retries: u32) -> Result<(), String> {
    let mut tries = 0;
    loop {
        let result = agent.post(url.secret()).content_type("application/json").send(body);
        tries += 1;
        let e = match result {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let may_pass = !matches!(e, ureq::Error::StatusCode(c) if c != 429 && c < 500);
        if !may_pass || tries > retries {
            return Err(format!("{e} ({tries} {})", if tries == 1 { "try" } else { "tries" }));
        }
        std::thread::sleep(backoff(tries));
    }
}

/// 0.5 s before the second try, doubling, at most 4 s.
fn backoff(tries: u32) -> Duration {
    Duration::from_millis(500u64 << (tries - 1).min(3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_half_a_second_to_four() {
        let ms: Vec<u128> = (1..=6).map(|t| backoff(t).as_millis()).collect();
        assert_eq!(ms, [500, 1000, 2000, 4000, 4000, 4000]);
    }

    /// A port nothing listens on: the failure comes back (connection refused), after the retries.
    #[test]
    fn a_dead_url_fails_after_its_tries_and_flush_returns() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let url = WebhookUrl::new(format!("http://127.0.0.1:{port}/hook/SECRET"));
        let agent: ureq::Agent =
            ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(1))).build().into();
        let err = deliver(&agent, &url, "{}", 1).unwrap_err();
        assert!(err.contains("2 tries"), "{err}");
        let q = Queue::start(url, Duration::from_millis(200), 0).unwrap();
        q.push(serde_json::json!({"text": "x"}));
        assert!(q.flush(Duration::from_secs(10)), "the sender gives up and answers");
        assert_eq!(q.queued.load(Ordering::Relaxed), 0);
    }
}
