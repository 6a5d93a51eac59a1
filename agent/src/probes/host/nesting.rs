//! Wake-up tracepoints whose nested runs a second program takes
//! (`bpf/include/nesting.bpf.h`): which they are, what the second program
//! is called, and which skipped runs were lost after all.

use std::collections::BTreeMap;

use crate::{abi::counter, probes::progstats::ProgStats};

/// A wake-up tracepoint with a second program, and the counter of the
/// runs that program took over.
pub(super) struct NestedWakeup {
    pub tracepoint: &'static str,
    pub rerun_counter: u32,
}

pub(super) const NESTED_WAKEUPS: [NestedWakeup; 2] = [
    NestedWakeup {
        tracepoint: "sched_waking",
        rerun_counter: counter::NESTED_WAKING,
    },
    NestedWakeup {
        tracepoint: "sched_wakeup",
        rerun_counter: counter::NESTED_WAKEUP,
    },
];

/// The second program of `tracepoint` (before its flavour's suffix).
pub(super) fn second_program(tracepoint: &str) -> String {
    format!("{tracepoint}_nested")
}

/// A program's name without its flavour's suffix.
fn unflavoured(program: &str) -> &str {
    program.strip_suffix("_btf").unwrap_or(program)
}

/// Program runs the kernel skipped, by program: a wake-up program's
/// skipped runs less those its second program ran (`reruns`, by
/// tracepoint); the second program's own skips are in the first's.
pub(super) fn lost_program_runs(
    programs: &[ProgStats],
    reruns: &[(&str, u64)],
) -> BTreeMap<String, u64> {
    let is_second = |name: &str| {
        NESTED_WAKEUPS
            .iter()
            .any(|w| unflavoured(name) == second_program(w.tracepoint))
    };
    programs
        .iter()
        .filter(|p| !is_second(&p.name))
        .map(|p| {
            let ran = reruns
                .iter()
                .find(|(tp, _)| *tp == unflavoured(&p.name))
                .map_or(0, |(_, n)| *n);
            (p.name.clone(), p.recursion_misses.saturating_sub(ran))
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::lost_program_runs;
    use crate::probes::progstats::ProgStats;

    fn prog(name: &str, recursion_misses: u64) -> ProgStats {
        ProgStats {
            name: name.into(),
            recursion_misses,
            ..Default::default()
        }
    }

    #[test]
    fn a_wakeup_run_the_second_program_ran_is_not_lost() {
        let programs = [
            prog("sched_waking_btf", 5),
            prog("sched_waking_nested_btf", 3),
            prog("sched_wakeup", 2),
            prog("sched_wakeup_nested", 0),
            prog("block_rq_complete_btf", 1),
            prog("sched_switch_btf", 0),
        ];
        let lost = lost_program_runs(&programs, &[("sched_waking", 4), ("sched_wakeup", 2)]);
        // 5 skipped, 4 of them run by the second program: one lost; the
        // second program's own skips are among the first's.
        assert_eq!(
            lost.into_iter().collect::<Vec<_>>(),
            [
                ("block_rq_complete_btf".to_string(), 1),
                ("sched_waking_btf".to_string(), 1)
            ]
        );
    }
}
