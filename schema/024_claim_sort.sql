-- Pepsi schema, version 24: the fair claim's generic plans read no more than its
-- window.
--
-- pepsi.workqueue_claim_fair (schemas 13 and 18) is PL/pgSQL, and PL/pgSQL switches a
-- statement to a generic plan, made without the parameters' values, after five calls
-- in a session when that plan looks no dearer. One of its statements, the read of a
-- stage's 513 oldest pending rows from the floor (`q.stage >= v_stage AND q.stage <=
-- v_stage … ORDER BY q.stage, q.workqueue_id LIMIT 513`), then went wrong: without
-- the stage's value the planner guessed a handful of rows, read them from the
-- covering (stage, sender_key, workqueue_id) index and sorted them (a top-N or an
-- incremental sort), and what it read was every pending row of the stage. From the
-- sixth claim of the dispatcher's session on, a claim cost time in proportion to the
-- stage's backlog: 1.5 ms with 1,000 rows waiting became 20 ms with 100,000. A
-- million rows happened to give statistics that kept the right plan.
--
-- The function no longer sorts to find rows in the order of an index: with
-- enable_sort and enable_incremental_sort off (beside the settings it has), a plan
-- that sorts what an index scan gives costs more than any that reads the pending
-- index in its order, so the 513 read stops at 513 entries under either kind of plan.
-- A sort the statement cannot do without (the ranking of the candidates) is made all
-- the same. This keeps the cached plans: forcing a custom plan per call
-- (plan_cache_mode) also flattened the cost, but planning every statement at every
-- claim cost about 1 ms more per call. The other claim, pepsi.workqueue_claim_oldest,
-- reads no more than its capacity under its generic plans (16 rows of 100,000 at the
-- eighth call), and stays as it is.

ALTER FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                          text[], float8[], int4, int8[], boolean[], int8[])
    SET enable_sort = off;
ALTER FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                          text[], float8[], int4, int8[], boolean[], int8[])
    SET enable_incremental_sort = off;
