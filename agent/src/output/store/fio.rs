//! fio's own figures, read from the JSON it writes, to sit beside iospan's.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::model::Op;

/// fio's own figures for a job and direction (from its JSON output).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FioFigures {
    pub job: String,
    pub op: Op,
    pub ios: u64,
    pub iops: f64,
    /// Total latency (submission to completion, fio's lat_ns).
    pub mean_us: f64,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
}

/// The file fio writes its JSON to, when its command line says so
/// (`--output-format` with json, and `--output=FILE`).
pub fn fio_json_output(command: &[String]) -> Option<PathBuf> {
    let prog = command.first()?;
    if Path::new(prog).file_name()? != "fio" {
        return None;
    }
    let mut format = None;
    let mut output = None;
    let mut it = command.iter().skip(1);
    while let Some(a) = it.next() {
        let (k, v) = match a.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (a.clone(), None),
        };
        let mut value = || v.clone().or_else(|| it.next().cloned());
        match k.as_str() {
            "--output-format" => format = value(),
            "--output" => output = value(),
            _ => {}
        }
    }
    format
        .filter(|f| f.split(',').any(|f| f.starts_with("json")))
        .and(output)
        .map(PathBuf::from)
}

/// fio's JSON output (`--output-format=json`), per job and direction.
pub fn parse_fio(text: &str) -> Result<Vec<FioFigures>> {
    // fio may print notes before the JSON document.
    let start = text.find('{').context("no JSON document in fio's output")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("fio's JSON output")?;
    let jobs = v["jobs"].as_array().context("fio's JSON has no jobs")?;
    let mut out = Vec::new();
    for j in jobs {
        for (key, op) in [("read", Op::Read), ("write", Op::Write)] {
            let d = &j[key];
            let ios = d["total_ios"].as_u64().unwrap_or(0);
            if ios == 0 {
                continue;
            }
            let lat = &d["lat_ns"];
            let pct = |p: &str| {
                lat["percentile"][p]
                    .as_f64()
                    .or_else(|| d["clat_ns"]["percentile"][p].as_f64())
                    .map(|ns| ns / 1e3)
            };
            out.push(FioFigures {
                job: j["jobname"].as_str().unwrap_or("").to_string(),
                op,
                ios,
                iops: d["iops"].as_f64().unwrap_or(0.0),
                mean_us: lat["mean"].as_f64().unwrap_or(0.0) / 1e3,
                p99_us: pct("99.000000"),
                p999_us: pct("99.900000"),
            });
        }
    }
    Ok(out)
}
