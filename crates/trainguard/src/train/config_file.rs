//! The text of a run's `config.yaml`: the resolved config under a header line naming the version
//! that wrote it, and how a file trainguard wrote is told from one a user wrote (what marks a
//! directory as a run, [`placement`](super::placement); what [`run_dir`](super::run_dir) keeps
//! aside before writing its own). Not where the file lives or when it is written.
use crate::config::Config;

/// The first line of the run's `config.yaml`: what marks it as trainguard's own, whichever
/// version wrote it (another version's, with keys added or retired since, is not the user's).
pub(super) fn header(version: &str) -> String {
    format!("# trainguard {version}: the run's resolved config, written again at each start")
}

/// What this version writes for `config`: its header, then the config as YAML.
pub(super) fn text(config: &Config) -> Result<String, serde_yaml::Error> {
    Ok(format!("{}\n{}", header(env!("CARGO_PKG_VERSION")), serde_yaml::to_string(config)?))
}

/// Whether `text` is a `config.yaml` that trainguard wrote, by any version and edited or not:
/// its header line, or (written before the header) the text this version writes for the
/// config it reads as.
pub(super) fn by_trainguard(text: &str) -> bool {
    header_version(text.split_once('\n').map_or(text, |(first, _)| first)).is_some() || as_written(text)
}

/// The version a [`header`] line names, when `first_line` is one.
pub(super) fn header_version(first_line: &str) -> Option<&str> {
    first_line
        .strip_prefix("# trainguard ")
        .and_then(|v| v.split_once(':'))
        .map(|(v, _)| v)
        .filter(|v| header(v) == first_line && !v.contains(' '))
}

/// `body` is exactly what this version writes for the config it reads as.
pub(super) fn as_written(body: &str) -> bool {
    crate::config::saved(body)
        .ok()
        .and_then(|c| serde_yaml::to_string(&c).ok())
        .is_some_and(|again| again == body)
}
