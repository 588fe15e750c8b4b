//! The dispatcher's own session and its lock (`src/dispatch/session.rs`,
//! `coordinator.rs`): a second dispatcher waits and exits 1, a SIGKILLed one leaves no
//! worker and its rows are reset by the next, the lock is re-taken after the
//! connections are killed, and no claim runs before the reconcile of a re-take.

use std::time::{Duration, Instant};

use crate::util::dispatcher::alive;
use crate::util::rows::{count, inject_fault, inject_many, wait_empty, wait_status};
use crate::util::{Scenario, assert_has, row_at, wait_until};

#[test]
fn a_second_dispatcher_exits_1_after_about_10_seconds_and_touches_nothing() {
    let (s, mut c) = Scenario::new("d-second")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\n")
        .connect();
    let held = inject_fault(&mut c, "s", "hang");
    let first = s.start();
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    let started = Instant::now();
    let mut second = s.start();
    let status = second.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{}", second.log());
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "it waited for the lock"
    );
    assert_has!(
        second.log(),
        "another pepsi-dispatch holds the dispatcher lock"
    );
    assert_eq!(
        row_at(&mut c, held),
        Some(("s".into(), "running".into())),
        "the first's row was not reset"
    );
    drop(first);
}

#[test]
fn after_sigkill_no_worker_survives_and_a_new_dispatcher_finishes_the_rows() {
    let (s, mut c) = Scenario::new("d-kill9")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {fault}\nQUEUE_LIMIT = 2\n")
        .connect();
    let held = inject_fault(&mut c, "s", "hang");
    let first = s.start();
    wait_status(&mut c, held, ("s", "running"), Duration::from_secs(20));
    // The row is claimed a moment before its worker is started.
    wait_until(Duration::from_secs(10), "its worker runs", || {
        !first.children().is_empty()
    });
    let workers = first.children();
    first.signal(libc::SIGKILL);
    wait_until(
        Duration::from_secs(10),
        "the killed dispatcher's workers die with it",
        || workers.iter().all(|&p| !alive(p)),
    );
    drop(first);
    assert_eq!(row_at(&mut c, held), Some(("s".into(), "running".into())));
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{}' WHERE workqueue_id = $1",
        &[&held],
    )
    .unwrap();
    let mut second = s.start();
    second.wait_log(
        "reset 1 running rows left by a previous dispatcher",
        Duration::from_secs(20),
    );
    wait_empty(&mut c, Duration::from_secs(20));
    assert!(second.terminate().success());
}

#[test]
fn after_its_connections_are_killed_the_dispatcher_retakes_the_lock_and_goes_on() {
    let (s, mut c) = Scenario::new("d-reconnect")
        .timers("")
        .stages("[stage-s]\nPROGRAM = {pass}\nNEXT = end\n\n[stage-end]\nPROGRAM = {discard}\n")
        .connect();
    let mut d = s.start();
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    // As if the database restarted: every session of the dispatcher and its workers.
    let killed = count(
        &mut c,
        "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name LIKE 'pepsi-%'",
    );
    assert!(killed >= 2, "killed {killed} sessions");
    d.wait_log("the dispatcher lock is held again", Duration::from_secs(20));
    inject_many(&mut c, "s", "a@x.example", 3);
    wait_empty(&mut c, Duration::from_secs(20));
    assert!(d.terminate().success(), "{}", d.log());
}

/// The coordinator alone, its events read from a channel.
mod coordinator {
    use std::sync::Arc;
    use std::time::Duration;

    use crossbeam_channel::{Receiver, unbounded};
    use pepsi::db::{self, pool::Pool};
    use pepsi::dispatch::coordinator::{self, Command};
    use pepsi::dispatch::events::{Event, EventSender};
    use pepsi::dispatch::floors::Starts;
    use pepsi::dispatch::scheduler::ClaimRequest;
    use pepsi::dispatch::session;
    use pepsi::durability::SynchronousCommit;
    use std::sync::atomic::AtomicBool;

    use crate::util::TestDb;
    use crate::util::rows::{count, inject_many};

    fn next(events: &Receiver<Event>, what: &str) -> Event {
        events
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no event while waiting for {what}"))
    }

    fn claim(stage: &str, n: i32) -> Command {
        Command::Claim(
            ClaimRequest::Oldest(vec![(stage.to_string(), n)]),
            Starts {
                floors: vec![None],
                walks: vec![true],
                sweeps: vec![None],
            },
        )
    }

    #[test]
    fn after_a_reconnect_no_claim_runs_before_the_reconcile_for_it() {
        let db = TestDb::new();
        let mut c = db.client();
        inject_many(&mut c, "s", "a@x.example", 3);
        let target = session::Target {
            conninfo: db.conninfo.clone(),
            durability: SynchronousCommit::Off,
        };
        let (client, _) = session::start(&target, |_| true)
            .expect("the session starts")
            .expect("the database is there");
        let poll = mio::Poll::new().unwrap();
        let waker = Arc::new(mio::Waker::new(poll.registry(), mio::Token(0)).unwrap());
        let (tx, events) = unbounded();
        let (commands, rx) = unbounded();
        coordinator::spawn(coordinator::Parts {
            client,
            target,
            pool: Pool::new(
                db::connection_config(&db.conninfo, "pepsi-dispatch").unwrap(),
                1,
                Duration::from_secs(1),
            ),
            commands: rx,
            events: EventSender::new(tx, waker),
            max_hops: 100,
            stopping: Arc::new(AtomicBool::new(false)),
        })
        .unwrap();
        // The database drops the coordinator's session while it is idle.
        let killed = count(
            &mut c,
            "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'pepsi-dispatch'",
        );
        assert_eq!(killed, 1);
        // A check finds it gone and re-takes the lock; a claim queued behind it must
        // wait for the loop's reconcile, which would otherwise reset the rows it hands out.
        commands.send(Command::Check).unwrap();
        commands.send(claim("s", 10)).unwrap();
        assert!(matches!(next(&events, "LockLost"), Event::LockLost));
        let Event::LockRegained(generation) = next(&events, "LockRegained") else {
            panic!("expected LockRegained");
        };
        assert!(
            matches!(next(&events, "the refused claim"), Event::ClaimFailed),
            "a claim ran before the reconcile"
        );
        let running = "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'";
        assert_eq!(count(&mut c, running), 0);
        // A reconcile for an earlier re-take does not open the gate.
        commands
            .send(Command::Reconcile {
                held: Vec::new(),
                generation: generation - 1,
            })
            .unwrap();
        commands.send(claim("s", 10)).unwrap();
        assert!(matches!(
            next(&events, "the claim refused again"),
            Event::ClaimFailed
        ));
        commands
            .send(Command::Reconcile {
                held: Vec::new(),
                generation,
            })
            .unwrap();
        commands.send(claim("s", 10)).unwrap();
        match next(&events, "the claim after the reconcile") {
            Event::Claimed { claims, .. } => assert_eq!(claims.len(), 3),
            _ => panic!("expected the rows to be claimed"),
        }
        assert_eq!(count(&mut c, running), 3);
        commands.send(Command::Reset).unwrap();
        assert!(matches!(
            next(&events, "the reset"),
            Event::ResetDone(Ok(3))
        ));
    }
}
