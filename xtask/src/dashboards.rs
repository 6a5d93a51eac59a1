//! Offline checks of dashboards/: every dashboard type-checks against
//! Grafana's published schema types (`tsc --strict`), and every PromQL
//! expression in it parses (`promtool check rules`, template variables
//! substituted). Grafana itself is not needed.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::{backends, sh};

const SCHEMA: &str = "@grafana/schema@13.2.3";
const TYPESCRIPT: &str = "typescript@5.9.3";

/// The npm packages, installed once outside the checkout.
fn node_modules() -> Result<PathBuf> {
    let dir = backends::cache_dir().join("npm-dashboards");
    let tsc = dir.join("node_modules/.bin/tsc");
    let schema = dir.join("node_modules/@grafana/schema/package.json");
    if tsc.exists() && schema.exists() {
        return Ok(dir);
    }
    if !sh::which("npm") {
        bail!("checking dashboards needs npm (Node.js) for {SCHEMA} and {TYPESCRIPT}");
    }
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("package.json"), "{\"private\": true}\n")?;
    sh::run(
        Command::new("npm")
            .args([
                "install",
                "--no-audit",
                "--no-fund",
                "--silent",
                SCHEMA,
                TYPESCRIPT,
            ])
            .current_dir(&dir),
    )?;
    Ok(dir)
}

/// Every dashboard under `dir`.
fn dashboards(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    v.sort();
    if v.is_empty() {
        bail!("no dashboards (*.json) in {}", dir.display());
    }
    Ok(v)
}

/// The PromQL of a dashboard: (where, expression) for every panel target
/// and every query variable's inner selector.
pub fn expressions(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((
                    format!("panel {} ({}) {}", p["id"], p["title"], t["refId"]),
                    e.to_string(),
                ));
            }
        }
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        let q = v["query"]["query"].as_str().or(v["query"].as_str());
        if let (Some(q), true) = (q, v["type"] == "query") {
            // label_values(SELECTOR, label): the selector is PromQL.
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|r| r.rsplit_once(','))
                .map_or(q, |(sel, _)| sel);
            out.push((format!("variable {}", v["name"]), inner.to_string()));
        }
    }
    out
}

/// Grafana's template variables replaced by values that parse.
fn substitute(e: &str) -> String {
    e.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$host", ".*")
        .replace("$vm", ".*")
        .replace("$vdisk", ".*")
}

/// The repository's dashboards.
pub fn check() -> Result<()> {
    check_dir(&sh::root().join("dashboards"))
}

/// The dashboards in `root`.
pub fn check_dir(root: &Path) -> Result<()> {
    let files = dashboards(root)?;
    let npm = node_modules()?;
    let promtool = backends::ensure(backends::Backend::Prometheus)?.with_file_name("promtool");
    // One work directory per check (beside node_modules, which it resolves).
    let work = npm.join(format!("check-{}", std::process::id()));
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    std::fs::create_dir_all(&work)?;
    let result = check_into(&files, &work, &npm, &promtool);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn check_into(files: &[PathBuf], work: &Path, npm: &Path, promtool: &Path) -> Result<()> {
    let mut rules = String::from("groups:\n  - name: dashboards\n    rules:\n");
    let mut n_expr = 0;
    for (i, f) in files.iter().enumerate() {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let d: Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", f.display()))?;
        // The object literal is checked as written: excess properties too.
        std::fs::write(
            work.join(format!("d{i}.ts")),
            format!(
                "// {}\nimport type {{ Dashboard }} from '@grafana/schema';\nexport const d: Dashboard = {text};\n",
                f.display()
            ),
        )?;
        for (where_, e) in expressions(&d) {
            let e = substitute(&e);
            if e.contains('$') {
                bail!(
                    "{}: {where_}: a template variable the check does not know: {e}",
                    f.display()
                );
            }
            rules.push_str(&format!(
                "      - record: dashboard:expr_{n_expr}\n        expr: {}\n",
                serde_json::to_string(&e)?
            ));
            n_expr += 1;
        }
    }
    std::fs::write(
        work.join("tsconfig.json"),
        r#"{"compilerOptions": {"strict": true, "noEmit": true, "target": "es2022", "module": "esnext",
  "moduleResolution": "bundler", "skipLibCheck": true, "typeRoots": []},
 "include": ["*.ts"]}"#,
    )?;
    sh::run(
        Command::new(npm.join("node_modules/.bin/tsc"))
            .args(["-p", "tsconfig.json"])
            .current_dir(work)
            .env("NODE_PATH", npm.join("node_modules")),
    )
    .context("dashboards do not match Grafana's schema types")?;
    let rules_file = work.join("rules.yml");
    std::fs::write(&rules_file, &rules)?;
    sh::run(
        Command::new(promtool)
            .args(["check", "rules"])
            .arg(&rules_file),
    )
    .context("a dashboard's PromQL does not parse")?;
    eprintln!(
        "xtask: {} dashboards match {SCHEMA}; their {n_expr} PromQL expressions parse",
        files.len()
    );
    Ok(())
}
