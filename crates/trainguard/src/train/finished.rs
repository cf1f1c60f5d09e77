//! A fresh start of a run that already finished: the same config (`config.yaml`, as the run
//! wrote it) in an `out_dir` whose stop record says it finished all of `train.max_steps`. The
//! command is then answered, not refused: there is nothing to train, and README's first command
//! runs again as written. Another config there is still another run (refused, exit 2).
use crate::config::Config;
use crate::job::stop_record::{self, Status};
use std::path::Path;

/// The steps the run in `out_dir` finished when it is `config`'s own, finished to the end.
pub fn finished_run(config: &Config) -> Option<u64> {
    let dir = &config.out_dir;
    let record = stop_record::read(dir)?;
    if record.status != Status::Finished || record.step != config.train.max_steps {
        return None;
    }
    // Its first line, the header naming the version that wrote it, is a YAML comment.
    let written = std::fs::read_to_string(dir.join(crate::fs::run_files::CONFIG)).ok()?;
    let theirs = crate::config::saved(&written).ok()?;
    (&theirs == config && has_final_weights(dir)).then_some(record.step)
}

fn has_final_weights(dir: &Path) -> bool {
    dir.join(crate::checkpoint::WEIGHTS_FILE).is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_config_finished_to_its_last_step_is_a_finished_run() {
        let d = tempfile::tempdir().unwrap();
        let config = Config { out_dir: d.path().to_path_buf(), ..Config::default() };
        let steps = config.train.max_steps;
        let write_config = |c: &Config| {
            let yaml = format!("# trainguard test: header\n{}", serde_yaml::to_string(c).unwrap());
            std::fs::write(d.path().join("config.yaml"), yaml).unwrap();
        };
        write_config(&config);
        std::fs::write(d.path().join(crate::checkpoint::WEIGHTS_FILE), b"weights").unwrap();
        assert_eq!(finished_run(&config), None, "no stop record: not known to have finished");
        stop_record::write(d.path(), &stop_record::StopRecord::stopped(steps - 1, "signal", None)).unwrap();
        assert_eq!(finished_run(&config), None, "stopped, not finished");
        stop_record::write(d.path(), &stop_record::StopRecord::finished(steps)).unwrap();
        assert_eq!(finished_run(&config), Some(steps));
        let mut longer = config.clone();
        longer.train.max_steps += 1;
        assert_eq!(finished_run(&longer), None, "more steps asked: another run");
        let mut other = config.clone();
        other.seed += 1;
        assert_eq!(finished_run(&other), None, "another config");
        std::fs::remove_file(d.path().join(crate::checkpoint::WEIGHTS_FILE)).unwrap();
        assert_eq!(finished_run(&config), None, "its final weights gone");
    }
}
