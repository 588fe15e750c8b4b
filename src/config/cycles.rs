//! The cycles of the stage graph through its stage references (`NEXT` and every
//! `*_STAGE` key): legal — the hop limit (`[pepsi-dispatch] MAX_HOPS`) bounds a message
//! that keeps going round — but worth a warning, which the dispatcher logs at start and
//! at a reload, and `pepsi-dispatch check` and `pepsi-queue config` print.
//!
//! Pure, and reads the graph only through its public methods; it changes nothing and
//! decides nothing about messages.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::graph::StageGraph;
use super::raw::ConfigError;

impl StageGraph {
    /// The stages a stage's references (`NEXT` and every `*_STAGE` key) name.
    fn successors(&self, name: &str) -> BTreeSet<&str> {
        self.get(name)
            .into_iter()
            .flat_map(|s| s.references().map(|(_, target)| target))
            .filter(|target| self.contains(target))
            .collect()
    }

    /// Every stage reachable from `start` through references, `start` itself only when
    /// a path leads back to it.
    fn reachable(&self, start: &str) -> BTreeSet<&str> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&str> = self.successors(start).into_iter().collect();
        while let Some(name) = todo.pop() {
            if seen.insert(name) {
                todo.extend(self.successors(name));
            }
        }
        seen
    }

    /// The cycles of the graph through its stage references (`NEXT` and every `*_STAGE`
    /// key): one per group of stages that all reach one another, each as the stage names
    /// along one shortest cycle through the group's first stage, that stage repeated at
    /// the end (`["loop1", "loop2", "loop1"]`). A cycle is legal — the hop limit bounds a
    /// message that keeps going round — but worth a warning.
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let reach: BTreeMap<&str, BTreeSet<&str>> = self
            .stages()
            .map(|stage| (stage.name.as_str(), self.reachable(&stage.name)))
            .collect();
        let mut grouped: BTreeSet<&str> = BTreeSet::new();
        let mut cycles = Vec::new();
        // Stages in name order, so each group is found from its first stage.
        for (&start, from_start) in &reach {
            if grouped.contains(start) || !from_start.contains(start) {
                continue;
            }
            let group: BTreeSet<&str> = from_start
                .iter()
                .copied()
                .filter(|other| reach[other].contains(start))
                .collect();
            grouped.extend(group.iter().copied());
            // Breadth first from `start` inside the group, back to `start`.
            let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = VecDeque::from([start]);
            let mut last = None;
            'search: while let Some(name) = queue.pop_front() {
                for next in self.successors(name) {
                    if next == start {
                        last = Some(name);
                        break 'search;
                    }
                    if group.contains(next) && !parent.contains_key(next) {
                        parent.insert(next, name);
                        queue.push_back(next);
                    }
                }
            }
            // Walk the parents back from the stage that leads to `start`.
            let mut middle = Vec::new();
            let mut at = last.expect("a stage in a group reaches itself");
            while at != start {
                middle.push(at.to_string());
                at = parent[at];
            }
            middle.reverse();
            let mut path = vec![start.to_string()];
            path.extend(middle);
            path.push(start.to_string());
            cycles.push(path);
        }
        cycles
    }

    /// A warning for each cycle of the graph (see [`StageGraph::cycles`]), located at
    /// its first stage's section.
    pub fn cycle_warnings(&self) -> Vec<ConfigError> {
        self.cycles()
            .into_iter()
            .map(|cycle| {
                let first = &self.get(&cycle[0]).expect("a cycle's stage is in the graph").section;
                ConfigError {
                    section: Some(first.name.clone()),
                    ..ConfigError::at(
                        first.origin.clone(),
                        format!(
                            "the stage references form a cycle: {} (legal, but a message can go round until [pepsi-dispatch] MAX_HOPS stops it)",
                            cycle.join(" → ")
                        ),
                    )
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::graph::tests::{PIPE, build, sections};

    #[test]
    fn cycles_are_found_once_each_as_a_path_back_to_their_first_stage() {
        let g = build(&sections(PIPE), &[]).unwrap();
        assert!(g.cycles().is_empty(), "a pipeline without a loop");
        let g = build(
            &sections(
                "[stage-loop1]\nPROGRAM = p\nNEXT = loop2\n\
                 [stage-loop2]\nPROGRAM = p\nNEXT = out\nELSE_STAGE = loop1\n\
                 [stage-out]\nPROGRAM = p\n\
                 [stage-self]\nPROGRAM = p\nBOUNCE_STAGE = self\n\
                 [stage-x]\nPROGRAM = p\nNEXT = y\n[stage-y]\nPROGRAM = p\nNEXT = z\nFAIL_STAGE = x\n\
                 [stage-z]\nPROGRAM = p\nNEXT = x\n",
            ),
            &[],
        )
        .unwrap();
        assert_eq!(
            g.cycles(),
            vec![
                vec!["loop1", "loop2", "loop1"],
                vec!["self", "self"],
                vec!["x", "y", "x"],
            ],
            "x→y→x is shorter than x→y→z→x; the group is reported once"
        );
        let w = g.cycle_warnings();
        assert_eq!(w.len(), 3);
        assert!(
            w[0].to_string().starts_with(
                "/g.conf:1: [stage-loop1] the stage references form a cycle: loop1 → loop2 → loop1"
            ),
            "{}",
            w[0]
        );
    }
}
