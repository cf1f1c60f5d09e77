//! Notifications (`notify.*`): where the webhook URL comes from (the config, or an environment
//! variable), and the [`Notifier`], which rank 0's event reporter feeds as a subscriber and the
//! binary's error path tells of a crash. It picks the events `notify.on` names and hands their
//! bodies to the background sender (`sender.rs`); what a body says is `payload.rs`'s. The URL is
//! a secret: only its scheme and host are ever logged ([`WebhookUrl`]).
pub mod payload;
mod sender;

use crate::config::notify::{NotifyConfig, WebhookUrl, DEFAULT_WEBHOOK_ENV};
use crate::events::{Event, Subscriber};
use payload::{name_of, Notice};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A webhook that cannot be used: exit code 2, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("notify.webhook_env: names {name}, which is not set in the environment (expected it to hold the webhook's http:// or https:// URL)")]
    EnvUnset { name: String },
    #[error("notify.webhook_env: {name} {why}")]
    EnvBadUrl { name: String, why: String },
    #[error("notify: cannot start the sender thread: {0}")]
    Thread(std::io::Error),
}

impl NotifyError {
    /// A refusal of the user's input (exit 2), not a failure of the machine.
    pub fn is_usage(&self) -> bool {
        !matches!(self, NotifyError::Thread(_))
    }
}

/// The webhook `cfg` names, from the config or the environment (`env` reads a variable); none
/// when neither gives one.
pub fn webhook(
    cfg: &NotifyConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<WebhookUrl>, NotifyError> {
    if let Some(url) = &cfg.webhook {
        return Ok(Some(url.clone()));
    }
    let (name, named) = match &cfg.webhook_env {
        Some(name) => (name.as_str(), true),
        None => (DEFAULT_WEBHOOK_ENV, false),
    };
    let url = match env(name).filter(|v| !v.is_empty()) {
        Some(v) => WebhookUrl::new(v),
        None if named => return Err(NotifyError::EnvUnset { name: name.into() }),
        None => return Ok(None),
    };
    match url.problem() {
        Some(why) => {
            Err(NotifyError::EnvBadUrl { name: name.into(), why: format!("holds a bad URL: {why}") })
        }
        None => Ok(Some(url)),
    }
}

/// Sends the run's notifications. Cheap to clone: the clones share one queue and thread.
#[derive(Clone)]
pub struct Notifier {
    inner: Arc<Inner>,
}

struct Inner {
    queue: sender::Queue,
    on: Vec<String>,
    run: String,
    host: String,
    /// What the end of the process waits for the last notifications.
    flush_wait: Duration,
}

impl Notifier {
    /// A notifier for the run in `out_dir` when `cfg` gives a webhook (and names an event);
    /// `env` reads the environment. Logs where it sends, scheme and host only.
    pub fn start(
        cfg: &NotifyConfig,
        out_dir: &Path,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, NotifyError> {
        let Some(url) = webhook(cfg, env)? else { return Ok(None) };
        if cfg.on.is_empty() {
            return Ok(None);
        }
        tracing::info!("notify: POST to {url} on {}", cfg.on.join(", "));
        let timeout = Duration::from_secs_f64(cfg.timeout_s);
        let queue = sender::Queue::start(url, timeout, cfg.retries).map_err(NotifyError::Thread)?;
        Ok(Some(Self {
            inner: Arc::new(Inner {
                queue,
                on: cfg.on.clone(),
                run: out_dir.display().to_string(),
                host: host_name(),
                flush_wait: timeout,
            }),
        }))
    }

    fn wants(&self, name: &str) -> bool {
        self.inner.on.iter().any(|n| n == name)
    }

    fn send(&self, notice: &Notice) {
        if self.wants(&notice.name) {
            self.inner.queue.push(notice.body(&self.inner.run, &self.inner.host));
        }
    }

    /// The process ends with exit `code` (`kind`: its name) because of `message`.
    pub fn crashed(&self, code: i32, kind: &str, message: &str) {
        self.send(&Notice::crashed(code, kind, message));
    }

    /// Waits, at most `notify.timeout_s`, for the queued notifications to go out: before the
    /// process exits. Whether they all did (or were given up on) in that time.
    pub fn flush(&self) -> bool {
        self.inner.queue.flush(self.inner.flush_wait)
    }
}

impl Subscriber for Notifier {
    fn event(&mut self, event: &Event) {
        if let Some(name) = name_of(event).filter(|n| self.wants(n)) {
            self.send(&Notice::of_event(name, event));
        }
    }
}

/// This machine's name for the notice (one of many nodes, or a laptop and a cluster).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_with(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_url_comes_from_the_config_then_the_named_variable_then_the_default_one() {
        let mut cfg = NotifyConfig::default();
        assert!(webhook(&cfg, env_with(&[])).unwrap().is_none(), "nothing set: no notifications");
        let from_default = webhook(&cfg, env_with(&[(DEFAULT_WEBHOOK_ENV, "https://ntfy.sh/t")])).unwrap();
        assert_eq!(from_default.unwrap().secret(), "https://ntfy.sh/t");
        cfg.webhook_env = Some("MY_HOOK".into());
        let e = webhook(&cfg, env_with(&[(DEFAULT_WEBHOOK_ENV, "https://ntfy.sh/t")])).unwrap_err();
        assert!(e.to_string().starts_with("notify.webhook_env: names MY_HOOK, which is not set"), "{e}");
        assert!(e.is_usage());
        let e = webhook(&cfg, env_with(&[("MY_HOOK", "hooks.slack.com/services/SECRET")])).unwrap_err();
        assert!(
            e.to_string().contains("MY_HOOK holds a bad URL") && !e.to_string().contains("SECRET"),
            "{e}"
        );
        let named = webhook(&cfg, env_with(&[("MY_HOOK", "https://discord.com/api/webhooks/1/t")])).unwrap();
        assert_eq!(named.unwrap().secret(), "https://discord.com/api/webhooks/1/t");
        cfg.webhook = Some(WebhookUrl::new("http://127.0.0.1:9/x"));
        assert_eq!(webhook(&cfg, env_with(&[])).unwrap().unwrap().secret(), "http://127.0.0.1:9/x");
    }
}
