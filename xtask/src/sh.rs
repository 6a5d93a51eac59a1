//! Running commands: loudly (every command echoed, failures name it), or
//! quietly behind one progress line, its output kept in a log file.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use anyhow::{bail, Context, Result};

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("workspace root")
}

/// Where cargo writes what it builds: `CARGO_TARGET_DIR` when set (CI
/// keeps one outside the clone, so a fresh clone builds only its own
/// crates), else the workspace's `target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        Some(d) => root().join(d),
        None => root().join("target"),
    }
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {}", show(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting `{}`", show(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", show(cmd));
    }
    Ok(())
}

/// Where `quietly` keeps each step's output.
pub fn log_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/iospan/logs")
}

/// Runs `cmd` behind one line naming `what`, its output kept in
/// `log_dir()/LOG.log`: a newcomer's first screen is the result, not a
/// package manager's or a compiler's lines. On a terminal the line counts
/// the seconds; a failure names the log and shows its last lines.
pub fn quietly(what: &str, log: &str, cmd: &mut Command) -> Result<()> {
    use std::io::{IsTerminal, Write};
    let dir = log_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{log}.log"));
    let file =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut child = cmd
        .stdout(file.try_clone()?)
        .stderr(file)
        .stdin(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting `{}`", show(cmd)))?;
    let tty = std::io::stderr().is_terminal();
    if !tty {
        eprintln!("xtask: {what} …");
    }
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if tty {
            eprint!("\rxtask: {what} … {} s", started.elapsed().as_secs());
            let _ = std::io::stderr().flush();
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    };
    let took = started.elapsed().as_secs_f64();
    if tty {
        eprint!("\r\x1b[K");
    }
    if status.success() {
        eprintln!("xtask: {what}: done in {took:.0} s");
        return Ok(());
    }
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    for l in &lines[lines.len().saturating_sub(20)..] {
        eprintln!("  {l}");
    }
    bail!(
        "{what} failed ({status}): `{}`; its whole output is in {}",
        show(cmd),
        path.display()
    )
}

pub fn output(cmd: &mut Command) -> Result<Output> {
    cmd.output()
        .with_context(|| format!("starting `{}`", show(cmd)))
}

/// Cargo (the one running us, if any) at the workspace's root, without
/// the variables of the program `cargo run` or `cargo test` runs.
pub fn cargo_command() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    without_run_env(&mut cmd).current_dir(root());
    cmd
}

/// `cmd` without the variables `cargo run` and `cargo test` set for the
/// program they run: a build script that watches one (ring's watches
/// CARGO_MANIFEST_DIR and OUT_DIR) would otherwise run again, and all above it rebuild,
/// whenever builds alternate between here and a shell (14 crates, about a
/// minute each time).
pub fn without_run_env(cmd: &mut Command) -> &mut Command {
    const SET_BY_RUN: [&str; 5] = [
        "OUT_DIR",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
    ];
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        let prefixed = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_EXE_"]
            .iter()
            .any(|p| k.starts_with(p));
        if prefixed || SET_BY_RUN.contains(&&*k) {
            cmd.env_remove(&*k);
        }
    }
    cmd
}

pub fn cargo(args: &[&str]) -> Result<()> {
    run(cargo_command().args(args))
}

/// Runs `cargo test …`, passing its output through, and adds up the
/// harness's "test result" lines: (passed, failed).
pub fn cargo_test(args: &[&str]) -> Result<(u64, u64)> {
    use std::io::{BufRead, BufReader};
    let mut cmd = cargo_command();
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    eprintln!("xtask: {}", show(&cmd));
    let started = std::time::Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting `{}`", show(&cmd)))?;
    // Cargo names each test binary on stderr as it starts it: passed on,
    // and queued in order to name the binary's time (its results come on
    // stdout, where its "running N tests" line may be read before or after
    // the name: the n-th such line is the n-th binary's).
    let names = std::sync::Arc::new((
        std::sync::Mutex::new(Vec::<String>::new()),
        std::sync::Condvar::new(),
    ));
    let stderr = child.stderr.take().expect("piped");
    let queue = names.clone();
    let forward = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if let Some(bin) = test_binary(&line) {
                let (lock, arrived) = &*queue;
                let mut q = lock.lock().unwrap_or_else(|p| p.into_inner());
                if q.is_empty() {
                    crate::phases::record("build tests", started.elapsed());
                }
                q.push(bin);
                arrived.notify_all();
            }
        }
    });
    let (mut passed, mut failed) = (0, 0);
    let mut started_binaries = 0;
    let mut this_binary = None;
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if line.starts_with("running ") {
            this_binary = nth_name(&names, started_binaries);
            started_binaries += 1;
        }
        if let Some(rest) = line.strip_prefix("test result: ") {
            if let Some(took) = finished_in(rest) {
                let name = this_binary.take();
                crate::phases::record(format!("test {}", name.as_deref().unwrap_or("?")), took);
            }
            let num = |word: &str| {
                rest.split(';')
                    .find_map(|part| {
                        part.trim()
                            .trim_start_matches("ok. ")
                            .trim_start_matches("FAILED. ")
                            .strip_suffix(word)
                    })
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            passed += num(" passed");
            failed += num(" failed");
        }
    }
    let status = child.wait()?;
    let _ = forward.join();
    if !status.success() && failed == 0 {
        bail!("`{}` failed ({status})", show(&cmd));
    }
    Ok((passed, failed))
}

/// The test binary a cargo `Running` line starts: `tests/block.rs`,
/// `unittests src/lib.rs` of a crate (named by its binary's file).
/// The n-th test binary cargo named, waiting a little for its line.
fn nth_name(
    names: &(std::sync::Mutex<Vec<String>>, std::sync::Condvar),
    n: usize,
) -> Option<String> {
    let (lock, arrived) = names;
    let q = lock.lock().unwrap_or_else(|p| p.into_inner());
    let (q, _) = arrived
        .wait_timeout_while(q, std::time::Duration::from_secs(5), |q| q.len() <= n)
        .unwrap_or_else(|p| p.into_inner());
    q.get(n).cloned()
}

fn test_binary(line: &str) -> Option<String> {
    if let Some(krate) = line.trim_start().strip_prefix("Doc-tests ") {
        return Some(format!("{} (doc)", krate.trim()));
    }
    let rest = line.trim_start().strip_prefix("Running ")?;
    let (what, bin) = rest.split_once(" (")?;
    let what = what.trim_start_matches("unittests ");
    match what.strip_prefix("tests/") {
        Some(t) => Some(t.trim_end_matches(".rs").to_string()),
        // Unit tests: the crate, from the binary's name (`iospan-1a2b…`).
        None => {
            let file = bin.trim_end_matches(')').rsplit('/').next()?;
            let krate = file.rsplit_once('-').map_or(file, |(k, _)| k);
            Some(format!("{krate} ({what})"))
        }
    }
}

/// `… finished in 52.07s` of a test result line.
fn finished_in(result: &str) -> Option<std::time::Duration> {
    let s = result
        .rsplit("finished in ")
        .next()?
        .trim()
        .strip_suffix('s')?;
    std::time::Duration::try_from_secs_f64(s.parse().ok()?).ok()
}

pub fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

pub fn show(cmd: &Command) -> String {
    std::iter::once(cmd.get_program().to_string_lossy().into_owned())
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// CPU time (user + system) process `pid` has used so far.
pub fn cpu_time_of(pid: u32) -> Result<std::time::Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command's closing parenthesis: utime, stime are 14, 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    let hz = rustix::param::clock_ticks_per_second().max(1) as f64;
    match f[..] {
        [u, s] => Ok(std::time::Duration::from_secs_f64((u + s) as f64 / hz)),
        _ => bail!("reading /proc/{pid}/stat: {stat}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_binary_is_named_by_its_running_line() {
        assert_eq!(
            test_binary("     Running tests/block.rs (target/release/deps/block-20a55b660013a9e1)")
                .as_deref(),
            Some("block")
        );
        assert_eq!(
            test_binary(
                "     Running unittests src/lib.rs (target/release/deps/iospan-e4aacccd8be57871)"
            )
            .as_deref(),
            Some("iospan (src/lib.rs)")
        );
        assert_eq!(
            test_binary("   Doc-tests iospan").as_deref(),
            Some("iospan (doc)")
        );
        assert_eq!(test_binary("   Compiling png v0.18.1"), None);
    }

    #[test]
    fn the_nth_running_line_is_the_nth_binary_named_even_when_named_late() {
        let names = std::sync::Arc::new((
            std::sync::Mutex::new(vec!["kvm".to_string()]),
            std::sync::Condvar::new(),
        ));
        let late = names.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            late.0.lock().unwrap().push("libvirt".into());
            late.1.notify_all();
        });
        assert_eq!(nth_name(&names, 0).as_deref(), Some("kvm"));
        assert_eq!(nth_name(&names, 1).as_deref(), Some("libvirt"));
        t.join().unwrap();
    }

    #[test]
    fn a_result_line_gives_its_time() {
        let r = "ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 52.07s";
        assert_eq!(
            finished_in(r),
            Some(std::time::Duration::from_secs_f64(52.07))
        );
        assert_eq!(finished_in("ok. 2 passed"), None);
    }
}
