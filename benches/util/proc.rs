//! CPU seconds from /proc, for the benchmarks' "where the time went" lines: of a
//! process (all its threads), of one named thread, of process families (the
//! postmaster and its backends, the dispatcher and its workers), and of the machine.
//! Linux only; a process that is gone reads as 0.

/// Clock ticks per second, for /proc CPU times.
fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// The fields after the command name of a /proc `stat` file.
fn stat_fields(path: &str) -> Vec<String> {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    after.split_whitespace().map(str::to_string).collect()
}

/// After the command name of a /proc `stat` file: user and system time (state is 0).
const OWN: &[usize] = &[11, 12];
/// The same of the children reaped (which count their own reaped children).
const OWN_AND_REAPED: &[usize] = &[11, 12, 13, 14];

/// CPU seconds in these fields of a /proc `stat` file (a process or a thread).
fn seconds_of_stat(path: &str, which: &[usize]) -> f64 {
    let fields = stat_fields(path);
    let ticks: f64 = which
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    ticks / clk_tck()
}

/// CPU seconds (user + system) of a /proc `stat` file (a process or a thread).
fn cpu_of_stat(path: &str) -> f64 {
    seconds_of_stat(path, OWN)
}

/// CPU seconds used so far by a process (all its threads, live and ended).
pub fn cpu_seconds(pid: u32) -> f64 {
    cpu_of_stat(&format!("/proc/{pid}/stat"))
}

/// CPU seconds used so far by the threads of `pid` named `name`.
pub fn thread_cpu_seconds(pid: u32, name: &str) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .map(|t| cpu_of_stat(&t.path().join("stat").to_string_lossy()))
        .sum()
}

/// The parent of a process.
pub fn parent_of(pid: u32) -> u32 {
    // After the command name: state is 0, ppid 1.
    stat_fields(&format!("/proc/{pid}/stat"))
        .get(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// CPU seconds used so far by a process and by the children it reaped (which count
/// their own reaped children: the time of every descendant that ended and was waited
/// for).
fn cpu_with_reaped(pid: u32) -> f64 {
    seconds_of_stat(&format!("/proc/{pid}/stat"), OWN_AND_REAPED)
}

/// CPU seconds used so far by each of `parents` and its descendants, in order: the
/// live ones (the dispatcher's workers are its launcher's children) and those that
/// ended and were reaped (a worker recycled, a backend whose session ended).
pub fn cpu_of_families(parents: &[u32]) -> Vec<f64> {
    let mut sums: Vec<f64> = parents.iter().map(|&p| cpu_with_reaped(p)).collect();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        // Up the chain of parents, a few generations at most.
        let mut up = parent_of(pid);
        for _ in 0..4 {
            if up <= 1 {
                break;
            }
            if let Some(i) = parents.iter().position(|&p| p == up) {
                sums[i] += cpu_with_reaped(pid);
                break;
            }
            up = parent_of(up);
        }
    }
    sums
}

/// The machine's seconds so far over all CPUs (`/proc/stat`).
#[derive(Clone, Copy, Default)]
pub struct Machine {
    /// Running anything: user, nice, system, irq and softirq.
    pub busy: f64,
    /// Idle while a disk read or write was outstanding.
    pub iowait: f64,
    /// Taken by the hypervisor for other machines (a shared host's noise).
    pub steal: f64,
}

impl Machine {
    pub fn now() -> Machine {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<f64> = stat
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        let at = |i: usize| ticks.get(i).copied().unwrap_or(0.0) / clk_tck();
        // user nice system idle iowait irq softirq steal …
        Machine {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            iowait: at(4),
            steal: at(7),
        }
    }

    /// What passed since `earlier`.
    pub fn since(self, earlier: Machine) -> Machine {
        Machine {
            busy: self.busy - earlier.busy,
            iowait: self.iowait - earlier.iowait,
            steal: self.steal - earlier.steal,
        }
    }
}
