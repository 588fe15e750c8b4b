//! A per-recipient split the database refuses (not a lost connection): the message is
//! retried with its verdict kept, so the recipients already delivered are not handed
//! over again (`src/worker/recipients.rs`).

use std::time::Duration;

use postgres::Client;

use crate::util::rows::due_now;
use crate::util::scenario::Scenario;
use crate::util::smarthost::{Script, Smarthost};
use crate::util::{state_of, wait_until};

const WAIT: Duration = Duration::from_secs(20);

/// The row's status, or None when it is gone.
fn status(c: &mut Client, id: i64) -> Option<String> {
    c.query_opt(
        "SELECT status::text FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .map(|r| r.get(0))
}

#[test]
fn a_refused_split_keeps_the_verdict_and_the_delivered_recipient_is_not_sent_again() {
    let host = Smarthost::start(Script::default().rcpt(
        "b@dest.example",
        &["550 5.1.1 <b@dest.example>: user unknown"],
    ));
    let (s, mut c) = Scenario::new("relay-split-refused")
        .timers("")
        .stages(&format!(
            "[stage-relay]\nPROGRAM = {{relay}}\nSMARTHOST = {}\n",
            host.address
        ))
        .connect();
    let to = vec!["a@dest.example".to_string(), "b@dest.example".to_string()];
    let id: i64 = c
        .query_one(
            "SELECT pepsi.workqueue_inject('relay', 'alice@origin.example', $1, \
             'Subject: x\r\n'::bytea, 'body\r\n'::bytea)",
            &[&to],
        )
        .unwrap()
        .get(0);
    // The split's new row is refused while the flag is set: an error of the database
    // that is not a lost connection.
    c.batch_execute(
        "CREATE TABLE public.refuse_split (x int); INSERT INTO public.refuse_split VALUES (1);
         CREATE FUNCTION public.refuse_split() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF EXISTS (SELECT 1 FROM public.refuse_split) THEN
                 RAISE EXCEPTION 'the split is refused for the test';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_split BEFORE INSERT ON pepsi.workqueue
             FOR EACH ROW EXECUTE FUNCTION public.refuse_split();",
    )
    .unwrap();
    let mut d = s.start();
    wait_until(WAIT, "the message paused after its refused split", || {
        status(&mut c, id).as_deref() == Some("paused")
    });
    assert_eq!(host.deliveries("a@dest.example"), 1);
    let state = state_of(&mut c, id);
    assert!(
        state["recipient_outcomes"].is_object(),
        "the verdict is kept for the retry: {state}"
    );
    // Once the split can be written, the retry takes the outcomes from the verdict.
    c.batch_execute("DELETE FROM public.refuse_split").unwrap();
    due_now(&mut c, id);
    wait_until(WAIT, "a done and b failed", || {
        c.query_one(
            "SELECT count(*) FROM pepsi.workqueue WHERE status = 'failed'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
            == 1
            && status(&mut c, id).is_none()
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert_eq!(
        host.deliveries("a@dest.example"),
        1,
        "the delivered recipient is not handed over again"
    );
    assert_eq!(host.commands("MAIL").len(), 1, "one transaction in all");
}
