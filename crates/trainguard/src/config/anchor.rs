//! A run's paths made absolute as it starts: `data.source`'s file, directory or glob and
//! `init_from` and `eval.tasks`' files, given relative to the directory the command ran in, are recorded in the run's
//! `config.yaml` against that directory, so that `sample`, `export`, `report` and a resume read
//! the same files from anywhere, and the run directory can move (the data stays where it was).
use super::Config;
use std::path::Path;

impl Config {
    /// This config with its input paths joined to `cwd` where they are relative. `out_dir`
    /// stays as given: it is where the run is, not what it reads.
    pub fn anchored(mut self, cwd: &Path) -> Config {
        anchor_source(&mut self.data.source, cwd);
        for s in &mut self.data.sources {
            anchor_source(&mut s.source, cwd);
        }
        if let Some(dir) = self.init_from.as_mut().filter(|d| d.is_relative()) {
            *dir = cwd.join(&dir);
        }
        for task in self.eval.tasks.iter_mut().filter(|t| t.path.is_relative()) {
            task.path = cwd.join(&task.path);
        }
        self
    }
}

/// `source`'s relative path (after `text:` or `tokens:`) joined to `cwd`.
fn anchor_source(source: &mut String, cwd: &Path) {
    for prefix in ["text:", "tokens:"] {
        if let Some(path) = source.strip_prefix(prefix) {
            if Path::new(path).is_relative() {
                *source = format!("{prefix}{}", cwd.join(path).display());
            }
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_inputs_are_joined_to_the_directory_the_command_ran_in() {
        let cwd = Path::new("/home/me/work");
        let mut c = Config::default();
        c.data.source = "text:data/corpus.txt".into();
        c.init_from = Some("hf/gpt2".into());
        c.eval.tasks = vec![
            crate::config::EvalTask { name: "a".into(), path: "tasks/hs.jsonl".into() },
            crate::config::EvalTask { name: "b".into(), path: "/abs/t.jsonl".into() },
        ];
        let a = c.anchored(cwd);
        assert_eq!(a.eval.tasks[0].path, Path::new("/home/me/work/tasks/hs.jsonl"));
        assert_eq!(a.eval.tasks[1].path, Path::new("/abs/t.jsonl"));
        assert_eq!(a.data.source, "text:/home/me/work/data/corpus.txt");
        assert_eq!(a.init_from.as_deref(), Some(Path::new("/home/me/work/hf/gpt2")));
        assert_eq!(a.out_dir, Config::default().out_dir, "out_dir stays as given");
        let mut c = Config::default();
        c.data.source = "tokens:shards/*train*.bin".into();
        assert_eq!(c.anchored(cwd).data.source, "tokens:/home/me/work/shards/*train*.bin");
        for kept in ["synthetic", "tokens:/data/fineweb", "text:/abs/file.txt"] {
            let mut c = Config::default();
            c.data.source = kept.into();
            assert_eq!(c.anchored(cwd).data.source, kept);
        }
        // A mixture's sources too.
        let mut c = Config::default();
        c.data.sources = ["tokens:web", "synthetic", "text:/abs/code.txt"]
            .map(|s| crate::config::SourceConfig { source: s.into(), weight: 1.0, name: None })
            .to_vec();
        let got: Vec<String> = c.anchored(cwd).data.sources.into_iter().map(|s| s.source).collect();
        assert_eq!(got, ["tokens:/home/me/work/web", "synthetic", "text:/abs/code.txt"]);
    }
}
