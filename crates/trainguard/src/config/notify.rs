//! The `notify:` section: where a run's notifications go and which events send one, and the
//! webhook URL as a secret ([`WebhookUrl`]): anything trainguard writes or prints of it (the
//! run's `config.yaml`, `config show`, a checkpoint's config, logs) shows its scheme and host
//! only. Parsing and the per-key rules; sending is `crate::notify`'s.
use serde::{Deserialize, Serialize};

/// The environment variable read for the URL when `notify.webhook` and `notify.webhook_env`
/// are unset (a URL set once in a shell profile or a job script notifies every run).
pub const DEFAULT_WEBHOOK_ENV: &str = "TRAINGUARD_NOTIFY_WEBHOOK";

/// The names `notify.on` accepts: `finished` (`run_finished`), `stopped` (a signal or
/// `train.max_duration`), `crashed` (the process ends with exit 1, 2, 3, 5 or 6, sent from its
/// error path), `escalated` (`oom_escalated`), and every other event of `events.jsonl` by its
/// own name: those of the divergence guard (`diverged`, `rolled_back`) included.
pub const NOTIFY_NAMES: [&str; 16] = [
    "finished",
    "stopped",
    "crashed",
    "escalated",
    "diverged",
    "rolled_back",
    "run_started",
    "resumed",
    "oom_recovered",
    "regrow_attempt",
    "checkpoint_saved",
    "checkpoint_failed",
    "nonfinite_skipped",
    "leak_suspected",
    "thrash_detected",
    "graphs_off",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NotifyConfig {
    /// An `http://` or `https://` URL to POST each notification to (Slack, Discord, ntfy, or
    /// anything reading a JSON `text`). A secret: written and shown as scheme and host only.
    pub webhook: Option<WebhookUrl>,
    /// The environment variable holding the URL when `webhook` is unset; it must be set when
    /// named. Unnamed, `TRAINGUARD_NOTIFY_WEBHOOK` is read when it is set.
    pub webhook_env: Option<String>,
    /// Which events send a notification ([`NOTIFY_NAMES`]).
    pub on: Vec<String>,
    /// Seconds one POST may take, and what the process waits at its end for the last one.
    pub timeout_s: f64,
    /// Further tries of a failed POST (0.5 s, 1 s, 2 s … apart).
    pub retries: u32,
}

impl Default for NotifyConfig {
    fn default() -> Self {
        Self {
            webhook: None,
            webhook_env: None,
            on: ["finished", "stopped", "crashed", "escalated", "diverged"].map(String::from).to_vec(),
            timeout_s: 5.0,
            retries: 2,
        }
    }
}

/// The most `notify.timeout_s` and `notify.retries` may be: a sender may lag the run, never
/// hold its end for long.
pub const MAX_NOTIFY_TIMEOUT_S: f64 = 60.0;
pub const MAX_NOTIFY_RETRIES: u32 = 10;

/// A webhook URL. It is a credential (Slack's and Discord's carry their token in the path, ntfy's
/// topic is its password), so its `Serialize`, `Debug` and `Display` give [`WebhookUrl::shown`]:
/// the scheme and host. Two configs whose hooks share scheme and host are the same run's
/// (`PartialEq`): where notifications go changes nothing trained, and a `config.yaml` that
/// holds the shown form must still match the config that wrote it.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct WebhookUrl(String);

impl WebhookUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The full URL, for the sender alone.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// `scheme://host[:port]`, and `/…` when the URL has more (a path, a query, a user).
    pub fn shown(&self) -> String {
        match split(&self.0) {
            Some((scheme, host, more)) => format!("{scheme}://{host}{}", if more { "/…" } else { "" }),
            None => "(not an http:// or https:// URL)".into(),
        }
    }

    /// `text` with the URL, and the part after its host, replaced by [`Self::shown`]'s: for
    /// an HTTP library's error message, which may quote what it was given.
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.replace(&self.0, &self.shown());
        if let Some(rest) = self.0.split_once("://").and_then(|(_, r)| r.find('/').map(|i| &r[i..])) {
            if rest.len() > 1 {
                out = out.replace(rest, "/…");
            }
        }
        out
    }

    /// What is wrong with the URL's form, if anything.
    pub fn problem(&self) -> Option<String> {
        match split(&self.0) {
            None => Some(format!(
                "expected an http:// or https:// URL with a host, got {}",
                if self.0.is_empty() {
                    "an empty string".to_string()
                } else {
                    format!("`{}`", first_word(&self.0))
                }
            )),
            Some(_) if self.0.chars().any(char::is_whitespace) => {
                Some(format!("expected a URL without spaces, got one to {}", self.shown()))
            }
            Some(_) => None,
        }
    }
}

/// At most what a URL's scheme would show: enough to see a mistake, never a secret's tail.
fn first_word(s: &str) -> String {
    let head: String = s.chars().take_while(|c| c.is_ascii_alphabetic()).take(10).collect();
    if head.len() < s.len() {
        format!("{head}…")
    } else {
        head
    }
}

/// (scheme, host with port, whether anything follows the host or precedes it) of an http(s)
/// URL with a host.
fn split(url: &str) -> Option<(&str, &str, bool)> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme_lower = scheme.to_ascii_lowercase();
    if scheme_lower != "http" && scheme_lower != "https" {
        return None;
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let (user, host) = match authority.rsplit_once('@') {
        Some((_, host)) => (true, host),
        None => (false, authority),
    };
    if host.is_empty() {
        return None;
    }
    let more = user || rest[end..].len() > 1 || rest[end..].starts_with(['?', '#']);
    Some((scheme, host, more))
}

impl Serialize for WebhookUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.shown())
    }
}

impl PartialEq for WebhookUrl {
    fn eq(&self, other: &Self) -> bool {
        self.shown() == other.shown()
    }
}

impl std::fmt::Debug for WebhookUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WebhookUrl({})", self.shown())
    }
}

impl std::fmt::Display for WebhookUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown())
    }
}

/// An environment variable's name as a shell would take it.
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The `notify.*` rules: each broken one as (key, what was expected).
pub(super) fn check(n: &NotifyConfig) -> Vec<(&'static str, String)> {
    let mut p = Vec::new();
    if let Some(why) = n.webhook.as_ref().and_then(WebhookUrl::problem) {
        p.push(("notify.webhook", why));
    }
    if let Some(name) = n.webhook_env.as_deref().filter(|v| !is_env_name(v)) {
        p.push((
            "notify.webhook_env",
            format!("expected an environment variable's name (letters, digits, _), got `{name}`"),
        ));
    }
    for name in n.on.iter().filter(|v| !NOTIFY_NAMES.contains(&v.as_str())) {
        p.push(("notify.on", format!("expected a list of {}; got `{name}`", NOTIFY_NAMES.join(", "))));
    }
    if !(n.timeout_s > 0.0 && n.timeout_s <= MAX_NOTIFY_TIMEOUT_S) {
        p.push((
            "notify.timeout_s",
            format!("expected seconds in (0, {MAX_NOTIFY_TIMEOUT_S}], got {}", n.timeout_s),
        ));
    }
    if n.retries > MAX_NOTIFY_RETRIES {
        p.push(("notify.retries", format!("expected at most {MAX_NOTIFY_RETRIES}, got {}", n.retries)));
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLACK: &str = "https://hooks.slack.com/services/T000/B000/XXXXSECRET";

    #[test]
    fn a_webhook_shows_its_scheme_and_host_only_and_showing_it_again_changes_nothing() {
        let url = WebhookUrl::new(SLACK);
        assert_eq!(url.shown(), "https://hooks.slack.com/…");
        assert_eq!(WebhookUrl::new(url.shown()).shown(), url.shown(), "idempotent");
        assert_eq!(WebhookUrl::new("http://127.0.0.1:8080").shown(), "http://127.0.0.1:8080");
        assert_eq!(WebhookUrl::new("http://127.0.0.1:8080/").shown(), "http://127.0.0.1:8080");
        assert_eq!(WebhookUrl::new("https://ntfy.sh?tpl=1").shown(), "https://ntfy.sh/…");
        assert_eq!(WebhookUrl::new("https://user:pw@example.com").shown(), "https://example.com/…");
        for text in [
            serde_json::to_string(&url).unwrap(),
            serde_yaml::to_string(&url).unwrap(),
            format!("{url:?}"),
            format!("{url}"),
        ] {
            assert!(!text.contains("SECRET") && text.contains("hooks.slack.com"), "{text}");
        }
    }

    #[test]
    fn scrub_removes_the_url_and_its_path_from_a_message() {
        let url = WebhookUrl::new(SLACK);
        let said = format!("POST {SLACK} failed; path /services/T000/B000/XXXXSECRET refused");
        let scrubbed = url.scrub(&said);
        assert!(!scrubbed.contains("SECRET") && !scrubbed.contains("T000"), "{scrubbed}");
        assert!(scrubbed.contains("https://hooks.slack.com/…"), "{scrubbed}");
    }

    #[test]
    fn configs_whose_hooks_share_a_host_are_equal_and_a_saved_config_reads_back_equal() {
        let mut c = super::super::Config::default();
        c.notify.webhook = Some(WebhookUrl::new(SLACK));
        let yaml = serde_yaml::to_string(&c).unwrap();
        assert!(!yaml.contains("SECRET"), "{yaml}");
        let back = super::super::saved(&yaml).unwrap();
        assert_eq!(back, c);
        assert_ne!(WebhookUrl::new("https://discord.com/api/webhooks/1/x"), WebhookUrl::new(SLACK));
    }

    fn keys(n: NotifyConfig) -> Vec<String> {
        check(&n).into_iter().map(|(key, _)| key.to_string()).collect()
    }

    #[test]
    fn every_rule_names_its_key() {
        assert!(keys(NotifyConfig::default()).is_empty());
        let bad = |f: fn(&mut NotifyConfig)| {
            let mut n = NotifyConfig::default();
            f(&mut n);
            keys(n)
        };
        assert_eq!(bad(|n| n.webhook = Some(WebhookUrl::new("ftp://x/y"))), ["notify.webhook"]);
        assert_eq!(bad(|n| n.webhook = Some(WebhookUrl::new("https:///path"))), ["notify.webhook"]);
        assert_eq!(bad(|n| n.webhook = Some(WebhookUrl::new("https://a b"))), ["notify.webhook"]);
        assert_eq!(bad(|n| n.webhook_env = Some("MY-HOOK".into())), ["notify.webhook_env"]);
        assert_eq!(bad(|n| n.on = vec!["finish".into()]), ["notify.on"]);
        assert_eq!(bad(|n| n.timeout_s = 0.0), ["notify.timeout_s"]);
        assert_eq!(bad(|n| n.timeout_s = f64::NAN), ["notify.timeout_s"]);
        assert_eq!(bad(|n| n.retries = 11), ["notify.retries"]);
        assert!(bad(|n| n.on = NOTIFY_NAMES.map(String::from).to_vec()).is_empty());
    }

    #[test]
    fn a_bad_url_is_not_echoed_past_its_scheme() {
        let why = WebhookUrl::new("hooks.slack.com/services/T/B/SECRET").problem().unwrap();
        assert!(!why.contains("SECRET"), "{why}");
    }
}
