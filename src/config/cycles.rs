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
    /// The stages (by name, so an index orders as its name) and, for each, the indexes
    /// its references (`NEXT` and every `*_STAGE` key) name, in name order, once each.
    fn adjacency(&self) -> (Vec<&str>, Vec<Vec<usize>>) {
        let names: Vec<&str> = self.stages().map(|s| s.name.as_str()).collect();
        let index: BTreeMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let successors = self
            .stages()
            .map(|s| {
                let targets: BTreeSet<usize> = s
                    .references()
                    .filter_map(|(_, target)| index.get(target).copied())
                    .collect();
                targets.into_iter().collect()
            })
            .collect();
        (names, successors)
    }

    /// The cycles of the graph through its stage references (`NEXT` and every `*_STAGE`
    /// key): one per group of stages that all reach one another, each as the stage names
    /// along one shortest cycle through the group's first stage, that stage repeated at
    /// the end (`["loop1", "loop2", "loop1"]`). A cycle is legal — the hop limit bounds a
    /// message that keeps going round — but worth a warning. Linear in the stages and
    /// references: the groups are the strongly connected components (Tarjan), and each
    /// group is searched once, within itself.
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let (names, successors) = self.adjacency();
        let group = strongly_connected(&successors);
        let mut members = vec![0usize; names.len()];
        for g in &group {
            members[*g] += 1;
        }
        let mut reported = vec![false; names.len()];
        let mut cycles = Vec::new();
        // Stages in name order, so each group is found from its first stage.
        for start in 0..names.len() {
            let g = group[start];
            let looped = members[g] > 1 || successors[start].contains(&start);
            if reported[g] || !looped {
                continue;
            }
            reported[g] = true;
            // Breadth first from `start` inside the group, back to `start`.
            let mut parent: BTreeMap<usize, usize> = BTreeMap::new();
            let mut queue = VecDeque::from([start]);
            let mut last = None;
            'search: while let Some(at) = queue.pop_front() {
                for &next in &successors[at] {
                    visited_edge();
                    if next == start {
                        last = Some(at);
                        break 'search;
                    }
                    if group[next] == g && !parent.contains_key(&next) {
                        parent.insert(next, at);
                        queue.push_back(next);
                    }
                }
            }
            // Walk the parents back from the stage that leads to `start`.
            let mut middle = Vec::new();
            let mut at = last.expect("a stage in a group reaches itself");
            while at != start {
                middle.push(names[at].to_string());
                at = parent[&at];
            }
            middle.reverse();
            let mut path = vec![names[start].to_string()];
            path.extend(middle);
            path.push(names[start].to_string());
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

/// The strongly connected component of every node of a graph given by its successor
/// lists, as a component number per node (Tarjan's algorithm, iterative: a long chain
/// of stages must not exhaust the stack).
fn strongly_connected(successors: &[Vec<usize>]) -> Vec<usize> {
    const UNSEEN: usize = usize::MAX;
    let n = successors.len();
    let mut order = vec![UNSEEN; n];
    let mut low = vec![0usize; n];
    let mut on_stack = vec![false; n];
    let mut stack = Vec::new();
    let mut group = vec![UNSEEN; n];
    let mut groups = 0;
    let mut next_order = 0;
    for root in 0..n {
        if order[root] != UNSEEN {
            continue;
        }
        // The depth-first path: each node with the position of its next successor.
        let mut path = vec![(root, 0usize)];
        order[root] = next_order;
        low[root] = next_order;
        next_order += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (node, ref mut at)) = path.last_mut() {
            if let Some(&next) = successors[node].get(*at) {
                *at += 1;
                visited_edge();
                if order[next] == UNSEEN {
                    order[next] = next_order;
                    low[next] = next_order;
                    next_order += 1;
                    stack.push(next);
                    on_stack[next] = true;
                    path.push((next, 0));
                } else if on_stack[next] {
                    low[node] = low[node].min(order[next]);
                }
                continue;
            }
            path.pop();
            if let Some(&(parent, _)) = path.last() {
                low[parent] = low[parent].min(low[node]);
            }
            if low[node] == order[node] {
                while let Some(member) = stack.pop() {
                    on_stack[member] = false;
                    group[member] = groups;
                    if member == node {
                        break;
                    }
                }
                groups += 1;
            }
        }
    }
    group
}

#[cfg(test)]
thread_local! {
    /// References followed by the cycle search on this thread (tests count them).
    static EDGES_VISITED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts a reference followed by the cycle search (in tests; nothing otherwise).
fn visited_edge() {
    #[cfg(test)]
    EDGES_VISITED.with(|c| c.set(c.get() + 1));
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

    #[test]
    fn the_cycle_search_follows_each_reference_a_bounded_number_of_times() {
        // A chain of 4,000 stages ending in a loop back to its middle: a search from
        // every stage would follow millions of references.
        let n = 4000;
        let mut text = String::new();
        for i in 0..n {
            let next = if i + 1 < n { i + 1 } else { n / 2 };
            text.push_str(&format!(
                "[stage-s{i:05}]\nPROGRAM = p\nNEXT = s{next:05}\n"
            ));
        }
        let g = build(&sections(&text), &[]).unwrap();
        super::EDGES_VISITED.with(|c| c.set(0));
        let cycles = g.cycles();
        let visited = super::EDGES_VISITED.with(|c| c.get());
        assert_eq!(cycles.len(), 1);
        assert_eq!(
            cycles[0].len(),
            n / 2 + 1,
            "the loop from s02000 round to itself"
        );
        assert_eq!(cycles[0][0], "s02000");
        // Each reference once by the component search, at most once more by the
        // shortest-cycle search of its group.
        assert!(
            visited <= 2 * n,
            "{visited} references followed for {n} stages"
        );
    }
}
