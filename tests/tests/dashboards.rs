//! dashboards/ checked offline against Grafana's schema types and
//! promtool; and the checks themselves refuse a broken dashboard.

use std::path::PathBuf;

use serde_json::Value;
use xtask::dashboards;

fn repo_dashboard() -> (PathBuf, Value) {
    let p = xtask::sh::root().join("dashboards/iospan-fleet.json");
    let v = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    (p, v)
}

/// A copy of the dashboard, changed by `edit`, alone in a directory.
fn variant(tag: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let (_, mut v) = repo_dashboard();
    edit(&mut v);
    let dir = tempfile::Builder::new()
        .prefix(&format!("iospan-dash-{tag}-"))
        .tempdir()
        .unwrap();
    std::fs::write(
        dir.path().join("d.json"),
        serde_json::to_string_pretty(&v).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn the_dashboards_pass_the_schema_and_promql_checks() {
    dashboards::check().unwrap_or_else(|e| panic!("{e:#}"));
    let (_, v) = repo_dashboard();
    let exprs = dashboards::expressions(&v);
    assert!(exprs.len() >= 12, "{exprs:?}");
    assert!(exprs.iter().any(|(_, e)| e.contains("histogram_quantile")));
    // Every metric a dashboard asks for is one the agent serves.
    let served =
        std::fs::read_to_string(xtask::sh::root().join("agent/src/output/metrics.rs")).unwrap();
    for (where_, e) in &exprs {
        for (i, _) in e.match_indices("iospan_") {
            let name: String = e[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(served.contains(base), "{where_}: {name} is not served");
        }
    }
}

#[test]
fn a_broken_expression_is_refused() {
    let dir = variant("promql", |v| {
        v["panels"][0]["targets"][0]["expr"] = "sum by (segment (rate(x[1m]))".into();
    });
    let e = dashboards::check_dir(dir.path()).expect_err("unbalanced parentheses");
    assert!(format!("{e:#}").contains("PromQL"), "{e:#}");
}

#[test]
fn a_field_of_the_wrong_type_is_refused() {
    let dir = variant("schema", |v| {
        v["graphTooltip"] = "shared".into();
    });
    let e = dashboards::check_dir(dir.path()).expect_err("graphTooltip is a number");
    assert!(format!("{e:#}").contains("schema"), "{e:#}");
}
