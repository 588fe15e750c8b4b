-- Pepsi schema, version 25: tenants and weights in the fair claim (SPEC §7, "Weights,
-- rates and tenants").
--
-- Tenants. Every row has a tenant_key: the tenant its sender belongs to. A sender key
-- matching a pattern of pepsi.tenants (the most literal pattern first) belongs to
-- 'tenant:NAME'; with [pepsi] TENANT_KEY = sender (pepsi.tenant_rule, which
-- pepsi-setup writes) any other is its own tenant; with default, its default tenant,
-- from the sender key alone
-- (pepsi.tenant_default): an authenticated user's domain ('domain:…', the login itself
-- as 'user:…' when it names none), an unauthenticated client's /24 (IPv4) or /48
-- (IPv6) ('net:…'), else the envelope sender's registrable domain ('domain:…'; for the
-- null sender, the first recipient's, as its sender key does). A BEFORE INSERT
-- trigger sets it on every row inserted, whoever writes it; no role may write it. It
-- is the tenant of the mail's sender as it arrived: a stage that rewrites the envelope
-- later (srs) changes the sender key, not the tenant. (A BEFORE UPDATE trigger would
-- make PostgreSQL compute every stored generated column again at every update of the
-- queue, the claims' included.) A statement that changes pepsi.tenants sets it again
-- on every row whose tenant it changed, in the same transaction (a trigger).
--
-- Registrable domains: the last two labels, or three under a two-letter country code
-- whose second level is one of the common generic ones (co.uk, com.au, org.br …). It
-- is not the Public Suffix List; a customer whose domains this groups wrongly is named
-- in pepsi.tenants.
--
-- The claim, hierarchical. The pending sender index becomes (stage, tenant_key,
-- sender_key, workqueue_id): the window of the fair claim is now one of at most 64
-- tenants (the loose index scan walks tenant keys from the stage's tenant cursor), and
-- within each tenant of the window a walk of its senders from that tenant's own
-- cursor, at most 64 / (tenants in the window) of them and at least one; a tenant with
-- more senders than that answers where its walk ended, so the next claim goes on from
-- there. Each sender's candidates are its oldest rows up to the cap, as before. The
-- order: within a tenant, its candidates by sender lead + k × average / sender weight
-- (k-th oldest of its sender); across tenants, the tenant's j-th candidate in that
-- order by tenant lead + j × average / tenant weight. So a tenant sending through a
-- hundred sender keys is ranked as one, and a tenant of weight 2 is ranked as if each
-- of its messages cost half. A stage's rows that fit a window, the sets of 513 rows
-- (few rows, a paused walk, a sweep) and the one-sender path are as in schema 24, with
-- the tenants found among the set's rows. Leads and weights are the dispatcher's: it
-- charges a tenant time / weight, and passes the leads and the weights of the tenants
-- and senders it knows; one it does not know is level with the least-served and
-- weighs 1.
--
-- Weights and rates: pepsi.fair_weights, a weight per tenant-key or sender-key pattern
-- and a rate per tenant-key pattern, read by the dispatcher at start and reload,
-- written by pepsi-settings. The rates are the dispatcher's (a GCRA in its memory):
-- the claim takes per stage the rows each tenant may take now, and a stage with any
-- limit goes through the ranking alone (no FIFO slots, no stage taken whole, no
-- one-sender path), which stops each tenant of its window there.
--
-- Seen: pepsi.tenant_shares, what each tenant got at each stage over the last minute,
-- written by the dispatcher, read by pepsi-queue status and metrics.

-- The tables an operator writes.
CREATE TABLE pepsi.tenants (
    pattern text PRIMARY KEY
        CHECK (pattern ~ '^[\x21-\x7e]{1,200}$'),
    tenant text NOT NULL
        CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$'),
    changed timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE pepsi.tenants IS
    'Tenants named explicitly (SPEC §7): a sender key matching pattern belongs to the '
    'tenant ''tenant:'' || tenant. Written by pepsi-settings tenant; every queue row''s '
    'tenant_key follows in the same transaction (trigger tenants_rekey).';
COMMENT ON COLUMN pepsi.tenants.pattern IS
    'A sender-key pattern: printable ASCII without spaces, * matching any characters '
    '(from:*.example.com, ip:192.0.2.*, user:*@example.com). When several match, the '
    'one with the most characters other than * wins, then the lower pattern.';
COMMENT ON COLUMN pepsi.tenants.tenant IS
    'The tenant''s name: letters, digits and . _ @ + -, at most 100 characters.';
COMMENT ON COLUMN pepsi.tenants.changed IS 'When the row was last written.';
COMMENT ON INDEX pepsi.tenants_pkey IS 'One tenant per pattern.';

CREATE TABLE pepsi.fair_weights (
    pattern text PRIMARY KEY
        CHECK (pattern ~ '^[\x21-\x7e]{1,200}$'),
    weight float8 NOT NULL DEFAULT 1
        CHECK (weight >= 0.01 AND weight <= 100),
    rate float8
        CHECK (rate >= 1.0 / 3600 AND rate <= 1000000),
    changed timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE pepsi.fair_weights IS
    'Fair-share weights and rates (SPEC §7): a tenant key matching pattern weighs weight '
    'among the tenants, a sender key among its tenant''s senders (default 1); a tenant '
    'may start at most rate messages a second at a stage. Written by pepsi-settings '
    'weight and rate; read by the dispatcher at start and reload.';
COMMENT ON COLUMN pepsi.fair_weights.pattern IS
    'A tenant-key pattern (tenant:NAME, domain:…, net:…, user:…) or a sender-key pattern '
    '(from:…, ip:…, user:…, null:…); * matches any characters; the most literal wins.';
COMMENT ON COLUMN pepsi.fair_weights.weight IS
    'The weight, 0.01 to 100: a weight-2 tenant is charged half the time per message.';
COMMENT ON COLUMN pepsi.fair_weights.rate IS
    'The most messages per second a tenant whose key matches pattern may start at each '
    'stage (NULL: no limit but the stage''s RATE), held by the dispatcher (SPEC §7 '
    '"Rates"); ignored for sender-key patterns.';
COMMENT ON COLUMN pepsi.fair_weights.changed IS 'When the row was last written.';
COMMENT ON INDEX pepsi.fair_weights_pkey IS 'One weight per pattern.';

-- What each tenant got at each stage over the last minute, as the dispatcher last
-- wrote it (SPEC §7 "Seen"): pepsi-queue status and metrics read it.
CREATE TABLE pepsi.tenant_shares (
    stage text NOT NULL,
    tenant text NOT NULL,
    worker_us bigint NOT NULL CHECK (worker_us >= 0),
    messages bigint NOT NULL CHECK (messages >= 0),
    throttled_us bigint NOT NULL CHECK (throttled_us >= 0),
    weight float8 NOT NULL,
    updated timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stage, tenant)
);

COMMENT ON TABLE pepsi.tenant_shares IS
    'Per stage and tenant, what the tenant got over the last minute (SPEC §7 "Seen"), '
    'the busiest 1,000 tenants of each stage, replaced by the dispatcher at every '
    'statistics tick (a row older than two minutes is stale).';
COMMENT ON COLUMN pepsi.tenant_shares.stage IS 'The stage.';
COMMENT ON COLUMN pepsi.tenant_shares.tenant IS 'The tenant key (pepsi.workqueue.tenant_key).';
COMMENT ON COLUMN pepsi.tenant_shares.worker_us IS 'Worker time its messages took, µs.';
COMMENT ON COLUMN pepsi.tenant_shares.messages IS 'Messages of it that ran.';
COMMENT ON COLUMN pepsi.tenant_shares.throttled_us IS
    'Time a rate held it back while the stage claimed, µs.';
COMMENT ON COLUMN pepsi.tenant_shares.weight IS 'Its weight (pepsi.fair_weights) then.';
COMMENT ON COLUMN pepsi.tenant_shares.updated IS 'When the dispatcher wrote the row.';
COMMENT ON INDEX pepsi.tenant_shares_pkey IS 'One row per stage and tenant.';

-- A pattern as LIKE reads it: \, % and _ literal, * any characters.
CREATE FUNCTION pepsi.pattern_like(p_pattern text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(
           p_pattern, '\', '\\'), '%', '\%'), '_', '\_'), '*', '%');

COMMENT ON FUNCTION pepsi.pattern_like(text) IS
    'A tenants or fair_weights pattern as a LIKE pattern: \ % _ taken literally, * as %.';

-- The registrable domain of a domain, as the head of this file says.
CREATE FUNCTION pepsi.registrable_domain(p_domain text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_d text := pg_catalog.rtrim(pg_catalog.lower(coalesce(p_domain, '')), '.');
    v_l text[];
    v_n int4;
BEGIN
    -- An address literal ([192.0.2.1]) or a name of one or two labels is itself.
    IF v_d LIKE '[%' THEN
        RETURN v_d;
    END IF;
    v_l := pg_catalog.string_to_array(v_d, '.');
    v_n := coalesce(cardinality(v_l), 0);
    IF v_n <= 2 THEN
        RETURN v_d;
    END IF;
    IF pg_catalog.length(v_l[v_n]) = 2
       AND v_l[v_n - 1] = ANY (ARRAY['ac', 'co', 'com', 'edu', 'gob', 'gov', 'go', 'ltd',
                                     'mil', 'ne', 'net', 'nic', 'or', 'org', 'plc', 'sch'])
    THEN
        RETURN pg_catalog.array_to_string(v_l[v_n - 2 : v_n], '.');
    END IF;
    RETURN pg_catalog.array_to_string(v_l[v_n - 1 : v_n], '.');
END $$;

COMMENT ON FUNCTION pepsi.registrable_domain(text) IS
    'A domain''s registrable part (lower case, no final dot): its last two labels, three '
    'under a two-letter country code with a common generic second level (co.uk); an '
    'address literal as it is. An approximation of the Public Suffix List.';

-- The default tenant of a sender key (see the head of this file).
CREATE FUNCTION pepsi.tenant_default(p_sender_key text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rest text;
    v_net inet;
BEGIN
    IF p_sender_key IS NULL THEN
        RETURN '';
    END IF;
    IF p_sender_key LIKE 'user:%' THEN
        v_rest := pg_catalog.substr(p_sender_key, 6);
        IF pg_catalog.strpos(v_rest, '@') > 0 THEN
            RETURN 'domain:' || pepsi.registrable_domain(
                pg_catalog.regexp_replace(v_rest, '^.*@', ''));
        END IF;
        RETURN p_sender_key;
    ELSIF p_sender_key LIKE 'ip:%' THEN
        BEGIN
            v_net := pg_catalog.substr(p_sender_key, 4)::inet;
        EXCEPTION WHEN invalid_text_representation THEN
            RETURN p_sender_key;
        END;
        RETURN 'net:' || pg_catalog.text(pg_catalog.network(pg_catalog.set_masklen(
            v_net, CASE WHEN pg_catalog.family(v_net) = 6 THEN 48 ELSE 24 END)));
    ELSIF p_sender_key LIKE 'from:%' OR p_sender_key LIKE 'null:%' THEN
        RETURN 'domain:' || pepsi.registrable_domain(
            pg_catalog.regexp_replace(p_sender_key, '^[a-z]+:', ''));
    END IF;
    RETURN p_sender_key;
END $$;

COMMENT ON FUNCTION pepsi.tenant_default(text) IS
    'The tenant of a sender key that no pepsi.tenants pattern names: user:LOGIN@DOMAIN → '
    'domain:REGISTRABLE, user:LOGIN → itself, ip:A.B.C.D → net:A.B.C.0/24, ip:V6/64 → '
    'net:V6/48, from:DOMAIN and null:DOMAIN → domain:REGISTRABLE.';

-- [pepsi] TENANT_KEY, as pepsi-setup last wrote it: how a sender key not named in
-- pepsi.tenants finds its tenant.
CREATE TABLE pepsi.tenant_rule (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    rule text NOT NULL CHECK (rule IN ('default', 'sender'))
);
INSERT INTO pepsi.tenant_rule (rule) VALUES ('default');

COMMENT ON TABLE pepsi.tenant_rule IS
    '[pepsi] TENANT_KEY as pepsi-setup schema last wrote it (one row): default '
    '(pepsi.tenant_default) or sender (each sender key its own tenant).';
COMMENT ON COLUMN pepsi.tenant_rule.only_row IS 'Always true: the table has one row.';
COMMENT ON COLUMN pepsi.tenant_rule.rule IS 'default or sender.';
COMMENT ON INDEX pepsi.tenant_rule_pkey IS 'One row.';

-- The tenant of a sender key: the most literal pepsi.tenants pattern matching it,
-- else its default tenant (TENANT_KEY = default) or itself (sender).
CREATE FUNCTION pepsi.tenant_of(p_sender_key text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_tenant text;
    v_rule text;
BEGIN
    -- One statement per row inserted (this runs in the insert trigger): the named
    -- tenant, if any, and the rule.
    SELECT (SELECT 'tenant:' || t.tenant
              FROM pepsi.tenants t
             WHERE p_sender_key LIKE pepsi.pattern_like(t.pattern)
             ORDER BY pg_catalog.length(pg_catalog.replace(t.pattern, '*', '')) DESC,
                      t.pattern
             LIMIT 1),
           (SELECT r.rule FROM pepsi.tenant_rule r)
      INTO v_tenant, v_rule;
    IF v_tenant IS NOT NULL THEN
        RETURN v_tenant;
    END IF;
    IF v_rule = 'sender' THEN
        RETURN coalesce(p_sender_key, '');
    END IF;
    RETURN pepsi.tenant_default(p_sender_key);
END $$;

COMMENT ON FUNCTION pepsi.tenant_of(text) IS
    'The tenant of a sender key: ''tenant:'' || the tenant of the most literal '
    'pepsi.tenants pattern matching it, else pepsi.tenant_default (TENANT_KEY = '
    'default) or the key itself (sender).';

-- Writes TENANT_KEY (pepsi-setup, as the owner) and, when it changed, keys every row
-- again. Returns the rows re-keyed, -1 when the rule was already p_rule.
CREATE FUNCTION pepsi.set_tenant_rule(p_rule text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE pepsi.tenant_rule SET rule = p_rule WHERE rule IS DISTINCT FROM p_rule;
    IF NOT FOUND THEN
        RETURN -1;
    END IF;
    RETURN pepsi.tenants_rekey();
END $$;

COMMENT ON FUNCTION pepsi.set_tenant_rule(text) IS
    'pepsi-setup: writes [pepsi] TENANT_KEY to pepsi.tenant_rule and, when it changed, '
    'sets every queue row''s tenant again; returns the rows re-keyed, -1 unchanged.';

ALTER TABLE pepsi.workqueue ADD COLUMN tenant_key text;
UPDATE pepsi.workqueue SET tenant_key = pepsi.tenant_of(sender_key);
ALTER TABLE pepsi.workqueue ALTER COLUMN tenant_key SET NOT NULL;

COMMENT ON COLUMN pepsi.workqueue.tenant_key IS
    'The tenant of the row''s sender as the row was inserted (pepsi.tenant_of of its '
    'sender key), set by the trigger workqueue_tenant and by pepsi.tenants_rekey; the '
    'fair claim shares a stage between tenants first (SPEC §7).';

-- The trigger's function runs as the owner: the writer of a row needs no access to
-- pepsi.tenants, and what it writes in tenant_key is replaced.
CREATE FUNCTION pepsi.workqueue_set_tenant()
RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Generated columns are computed after BEFORE triggers: the key from its parts.
    NEW.tenant_key := pepsi.tenant_of(
        pepsi.sender_key(NEW.auth_user, NEW.client_ip, NEW.mail_from, NEW.rcpt_to));
    RETURN NEW;
END $$;

COMMENT ON FUNCTION pepsi.workqueue_set_tenant() IS
    'The trigger workqueue_tenant''s function: a row''s tenant_key from its sender key.';

CREATE TRIGGER workqueue_tenant
    BEFORE INSERT ON pepsi.workqueue
    FOR EACH ROW EXECUTE FUNCTION pepsi.workqueue_set_tenant();

COMMENT ON TRIGGER workqueue_tenant ON pepsi.workqueue IS
    'Sets tenant_key on every insert, whatever the writer gave.';

-- The tenants' pending index replaces the senders'.
CREATE INDEX workqueue_pending_tenant_idx
    ON pepsi.workqueue (stage, tenant_key, sender_key, workqueue_id)
    WHERE status = 'pending';
DROP INDEX pepsi.workqueue_pending_sender_idx;

COMMENT ON INDEX pepsi.workqueue_pending_tenant_idx IS
    'Pending rows by stage, tenant and sender: the fair claim''s walk of tenants, of each '
    'tenant''s senders and each sender''s oldest rows (SPEC §7).';

-- Every row's tenant again, after pepsi.tenants changed. Returns the rows changed.
CREATE FUNCTION pepsi.tenants_rekey()
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_n bigint;
BEGIN
    UPDATE pepsi.workqueue q SET tenant_key = pepsi.tenant_of(q.sender_key)
     WHERE q.tenant_key IS DISTINCT FROM pepsi.tenant_of(q.sender_key);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $$;

COMMENT ON FUNCTION pepsi.tenants_rekey() IS
    'Sets every queue row''s tenant_key again from pepsi.tenants (after it changed), '
    'from the row''s sender key as it is now; returns how many rows changed tenant.';

-- The claim's UPDATE (schema 23) answers each claimed row's tenant too, for the
-- dispatcher's charges; otherwise as in schema 23.
DROP FUNCTION pepsi.workqueue_take(int8[], int4);
CREATE FUNCTION pepsi.workqueue_take(p_ids int8[], p_max_hops int4)
RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
               looped boolean, tenant_key text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    UPDATE pepsi.workqueue q
           SET status = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > p_max_hops
                             THEN 'failed' ELSE 'running' END::pepsi.workqueue_status,
               hops = q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int,
               hop_stage = q.stage,
               claim = ('x' || pg_catalog.substr(pg_catalog.replace(
                           pg_catalog.gen_random_uuid()::text, '-', ''), 1, 16))::bit(64)::bigint,
               state = CASE WHEN q.hops + (q.hop_stage IS DISTINCT FROM q.stage)::int > p_max_hops
                            THEN q.state || pg_catalog.jsonb_build_object(
                                'failure_class', 'looped', 'failed_stage', q.stage,
                                'last_error', 'looped: claimed at a changed stage more than MAX_HOPS ('
                                              || p_max_hops || ') times')
                            ELSE q.state END
     WHERE q.workqueue_id = ANY (p_ids) AND q.status::text = 'pending'
    RETURNING q.workqueue_id, q.stage, q.sender_key, q.claim, q.status = 'failed',
              q.tenant_key;
END $$;

COMMENT ON FUNCTION pepsi.workqueue_take(int8[], int4) IS
    'The claim of rows a pick locked (pepsi.workqueue_claim_oldest and _fair): each '
    'pending one of p_ids set running (or failed looped past p_max_hops) under a new '
    'claim token of its own (60 random bits from pg_strong_random, made in this '
    'statement as pepsi.claim_token makes one). Returns the rows claimed, with their '
    'tenants.';

-- Whoever writes pepsi.tenants, every row's tenant follows in the same transaction;
-- whoever writes pepsi.fair_weights, the dispatcher reloads.
CREATE FUNCTION pepsi.tenants_changed()
RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pepsi.tenants_rekey();
    RETURN NULL;
END $$;

COMMENT ON FUNCTION pepsi.tenants_changed() IS
    'Trigger function: pepsi.tenants_rekey() after a statement changed pepsi.tenants.';

CREATE TRIGGER tenants_rekey
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON pepsi.tenants
    FOR EACH STATEMENT EXECUTE FUNCTION pepsi.tenants_changed();
CREATE TRIGGER fair_weights_notify
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON pepsi.fair_weights
    FOR EACH STATEMENT EXECUTE FUNCTION pepsi.config_override_notify();

COMMENT ON TRIGGER tenants_rekey ON pepsi.tenants IS
    'Sets every queue row''s tenant again after each statement that changes the table.';
COMMENT ON TRIGGER fair_weights_notify ON pepsi.fair_weights IS
    'NOTIFY config_changed after every statement that changes the weights: the '
    'dispatcher reads them again.';

DROP FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                         text[], float8[], int4, int8[], boolean[], int8[]);
DELETE FROM pepsi.role_grants
 WHERE object = 'FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[], text[], float8[], int4, int8[], boolean[], int8[])'
    OR (role = 'pepsi_dispatch' AND object = 'TABLE pepsi.workqueue'
        AND privilege LIKE 'SELECT%');

CREATE FUNCTION pepsi.workqueue_claim_fair(
    p_stages text[],
    p_caps int4[],
    p_fifo int4[],
    p_avg_us float8[],
    p_cursor text[],
    p_lead_stage text[],
    p_lead_sender text[],
    p_lead_us float8[],
    p_max_hops int4,
    p_floors int8[],
    p_walk boolean[] DEFAULT NULL,
    p_sweeps int8[] DEFAULT NULL,
    p_lead_w float8[] DEFAULT NULL,
    p_tlead_stage text[] DEFAULT NULL,
    p_tlead_tenant text[] DEFAULT NULL,
    p_tlead_us float8[] DEFAULT NULL,
    p_tlead_w float8[] DEFAULT NULL,
    p_tcur_stage text[] DEFAULT NULL,
    p_tcur_tenant text[] DEFAULT NULL,
    p_tcur_sender text[] DEFAULT NULL,
    p_allow_default int4[] DEFAULT NULL,
    p_allow_stage text[] DEFAULT NULL,
    p_allow_tenant text[] DEFAULT NULL,
    p_allow_n int4[] DEFAULT NULL
) RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, claim bigint,
                 due float8, looped boolean, window_end text, next_floor bigint,
                 next_sweep bigint, tenant_key text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET enable_sort = off
SET enable_incremental_sort = off
AS $$
DECLARE
    v_n int4 := coalesce(cardinality(p_stages), 0);
    v_due float8;
    v_stage text;
    v_cap int4;
    v_fifo int4;
    v_avg float8;
    v_cursor text;
    v_lo int8;
    v_sw int8;
    v_part int4;
    v_floor_part bigint[];
    v_set_pos int4;
    v_tenants text[];
    v_tcurs text[];
    v_tfirst text[];
    v_budget int4;
    v_walk_i int4[];
    v_walk_n int4[];
    v_walk_keys text[];
    v_ws_tenants text[];
    v_ws_keys text[];
    v_tc_stage text[] := '{}';
    v_tc_tenant text[] := '{}';
    v_tc_end text[] := '{}';
    v_t1 text;
    v_t2 text;
    v_s1 text;
    v_s2 text;
    v_window_end text;
    v_head bigint[];
    v_set_ids bigint[];
    v_set_keys text[];
    v_set_tenants text[];
    v_cand_ids bigint[];
    v_cand_keys text[];
    v_cand_tis int4[];
    v_ws_tis int4[];
    v_tl_lead float8[];
    v_tl_w float8[];
    v_tl_least float8;
    v_cand_ks int8[];
    v_oldest bigint[];
    v_order bigint[];
    v_try bigint[];
    v_got bigint[];
    v_pos int4;
    v_locked bigint[] := '{}';
    v_ends text[] := '{}';
    v_next int8[] := '{}';
    v_sweep_next int8[] := '{}';
    v_one boolean;
    v_limited boolean;
    v_single boolean;
    v_tl_allow int4[];
    i int4;
BEGIN
    IF coalesce(cardinality(p_caps), 0) <> v_n OR coalesce(cardinality(p_fifo), 0) <> v_n
       OR coalesce(cardinality(p_avg_us), 0) <> v_n OR coalesce(cardinality(p_cursor), 0) <> v_n
       OR coalesce(cardinality(p_floors), v_n) <> v_n
       OR coalesce(cardinality(p_walk), v_n) <> v_n
       OR coalesce(cardinality(p_sweeps), v_n) <> v_n
    THEN
        RAISE EXCEPTION 'workqueue_claim_fair: the per-stage arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_lead_sender), 0) <> coalesce(cardinality(p_lead_stage), 0)
       OR coalesce(cardinality(p_lead_us), 0) <> coalesce(cardinality(p_lead_stage), 0)
       OR coalesce(cardinality(p_lead_w), cardinality(p_lead_stage), 0)
          <> coalesce(cardinality(p_lead_stage), 0)
       OR coalesce(cardinality(p_tlead_tenant), 0) <> coalesce(cardinality(p_tlead_stage), 0)
       OR coalesce(cardinality(p_tlead_us), 0) <> coalesce(cardinality(p_tlead_stage), 0)
       OR coalesce(cardinality(p_tlead_w), 0) <> coalesce(cardinality(p_tlead_stage), 0)
       OR coalesce(cardinality(p_tcur_tenant), 0) <> coalesce(cardinality(p_tcur_stage), 0)
       OR coalesce(cardinality(p_tcur_sender), 0) <> coalesce(cardinality(p_tcur_stage), 0)
       OR coalesce(cardinality(p_allow_default), v_n) <> v_n
       OR coalesce(cardinality(p_allow_tenant), 0) <> coalesce(cardinality(p_allow_stage), 0)
       OR coalesce(cardinality(p_allow_n), 0) <> coalesce(cardinality(p_allow_stage), 0)
    THEN
        RAISE EXCEPTION 'workqueue_claim_fair: the lead arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT count(DISTINCT s.s) <> count(*) FROM unnest(p_stages) AS s(s)) THEN
        RAISE EXCEPTION 'workqueue_claim_fair: a stage is named twice'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- The earliest paused row, as a difference of epochs (see workqueue_claim_oldest).
    SELECT extract(epoch FROM min(q.timeout))::float8 - extract(epoch FROM now())::float8
      INTO v_due
      FROM pepsi.workqueue q WHERE q.status = 'paused';

    FOR i IN 1 .. v_n LOOP
        v_stage := p_stages[i];
        v_cap := greatest(coalesce(p_caps[i], 0), 0);
        v_fifo := least(greatest(coalesce(p_fifo[i], 0), 0), v_cap);
        v_avg := CASE WHEN p_avg_us[i] > 0 THEN p_avg_us[i] ELSE 1 END;
        v_cursor := p_cursor[i];
        v_lo := p_floors[i];
        -- A sweep at or below the floor is none: the set is read from the floor.
        v_sw := CASE WHEN p_sweeps[i] > coalesce(v_lo, -9223372036854775808)
                     THEN p_sweeps[i] END;
        IF v_cap = 0 OR v_stage IS NULL THEN
            v_ends := v_ends || v_cursor;
            v_next := v_next || v_lo;
            v_sweep_next := v_sweep_next || v_sw;
            CONTINUE;
        END IF;

        -- Rates (§7): a stage where some tenant may start fewer rows than the cap is
        -- claimed through the ranking alone, which holds each tenant of the window to
        -- its allowance: no FIFO slots, no row taken whole or by the one-sender path.
        v_limited := p_allow_default[i] IS NOT NULL
                     OR (SELECT bool_or(a.stage = v_stage)
                           FROM unnest(p_allow_stage) AS a(stage));
        v_limited := coalesce(v_limited, false);
        IF v_limited THEN
            v_fifo := 0;
        END IF;
        IF v_sw IS NULL THEN
            -- 0. As in schema 9, from the floor: the stage's oldest pending rows, at
            -- most 65 entries past the floor; all of them when they fit the cap and a
            -- window.
            v_head := ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                   AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                 ORDER BY q.stage, q.workqueue_id LIMIT least(v_cap, 64) + 1);
        ELSE
            -- 0. From a sweep, only the oldest rows' slots are read from the floor: the
            -- rows the sweep passed over lie there, among the entries of every row
            -- claimed above them, and the set read below tells whether all fit.
            v_head := ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                   AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                 ORDER BY q.stage, q.workqueue_id LIMIT v_fifo);
        END IF;
        v_set_ids := NULL;
        v_set_keys := NULL;
        v_set_tenants := NULL;
        v_part := 0;
        -- One sender waiting (schema 24): the stage's first and last sender keys in the
        -- sender index are one. Then the fair order is the oldest rows' order, and the
        -- claim takes them from the head, up to the cap, as the oldest-first claim
        -- does: no set to read, no window, no ranking. Not from a sweep, nor while the
        -- walk is paused (the first probe starts below the floor, as the walk's do).
        v_one := false;
        IF v_sw IS NULL AND coalesce(p_walk[i], true) AND NOT v_limited
           AND cardinality(v_head) > least(v_cap, 64) THEN
            SELECT q.tenant_key, q.sender_key INTO v_t1, v_s1 FROM pepsi.workqueue q
             WHERE q.stage = v_stage AND q.status = 'pending'
             ORDER BY q.tenant_key, q.sender_key LIMIT 1;
            SELECT q.tenant_key, q.sender_key INTO v_t2, v_s2 FROM pepsi.workqueue q
             WHERE q.stage = v_stage AND q.status = 'pending'
             ORDER BY q.tenant_key DESC, q.sender_key DESC LIMIT 1;
            v_one := v_t1 IS NOT DISTINCT FROM v_t2 AND v_s1 IS NOT DISTINCT FROM v_s2;
            IF v_one AND v_cap > 64 THEN
                v_head := ARRAY(
                    SELECT q.workqueue_id FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT v_cap + 1);
            END IF;
        END IF;
        IF v_one THEN
            NULL;
        ELSIF v_sw IS NOT NULL THEN
            -- The set read from the sweep (see the head of this file): the stage's 513
            -- oldest rows from it, and when fewer wait there, after them the oldest
            -- from the floor up to the sweep (the sweep wraps round). In that order, so
            -- that a position in the set is a place in the sweep. Fewer than 513 in
            -- all: they are every pending row of the stage from the floor.
            SELECT coalesce(array_agg(x.workqueue_id ORDER BY x.workqueue_id), '{}'),
                   coalesce(array_agg(x.sender_key ORDER BY x.workqueue_id), '{}'),
                   coalesce(array_agg(x.tenant_key ORDER BY x.workqueue_id), '{}')
              INTO v_set_ids, v_set_keys, v_set_tenants
              FROM (SELECT q.workqueue_id, q.sender_key, q.tenant_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= v_sw
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
            v_part := cardinality(v_set_ids);
            IF v_part < 513 THEN
                SELECT v_set_ids || coalesce(array_agg(x.workqueue_id ORDER BY x.workqueue_id), '{}'),
                       v_set_keys || coalesce(array_agg(x.sender_key ORDER BY x.workqueue_id), '{}'),
                       v_set_tenants
                           || coalesce(array_agg(x.tenant_key ORDER BY x.workqueue_id), '{}')
                  INTO v_set_ids, v_set_keys, v_set_tenants
                  FROM (SELECT q.workqueue_id, q.sender_key, q.tenant_key FROM pepsi.workqueue q
                         WHERE q.stage >= v_stage AND q.stage <= v_stage
                           AND q.status = 'pending'
                           AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                           AND q.workqueue_id < v_sw
                         ORDER BY q.stage, q.workqueue_id LIMIT 513 - v_part) x;
            END IF;
        ELSIF cardinality(v_head) > least(v_cap, 64) OR v_limited THEN
            SELECT array_agg(x.workqueue_id ORDER BY x.workqueue_id),
                   array_agg(x.sender_key ORDER BY x.workqueue_id),
                   array_agg(x.tenant_key ORDER BY x.workqueue_id)
              INTO v_set_ids, v_set_keys, v_set_tenants
              FROM (SELECT q.workqueue_id, q.sender_key, q.tenant_key FROM pepsi.workqueue q
                     WHERE q.stage >= v_stage AND q.stage <= v_stage AND q.status = 'pending'
                       AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                     ORDER BY q.stage, q.workqueue_id LIMIT 513) x;
        END IF;
        IF v_one OR (v_sw IS NULL AND cardinality(v_head) <= least(v_cap, 64)
                     AND NOT v_limited) THEN
            v_order := v_head;
            v_ends := v_ends || NULL::text;
        ELSIF v_sw IS NOT NULL AND cardinality(v_set_ids) <= least(v_cap, 64)
              AND NOT v_limited THEN
            v_order := v_set_ids;
            v_ends := v_ends || NULL::text;
        ELSE
            IF cardinality(v_set_ids) <= 512 OR NOT coalesce(p_walk[i], true) THEN
                -- 1–3 from the stage's pending rows themselves, when there are no more
                -- than 512 of them from the floor (read in id order, with their senders
                -- and tenants): they are every pending row of the stage, so the tenants
                -- among them, in key order from just after the cursor and wrapping
                -- round, are the window the loose index scan would find; every sender of
                -- those tenants among them is walked, and a sender's oldest rows among
                -- them are its candidates. The walk cannot start at the floor; this read
                -- does. When p_walk pauses the stage's walk (the dispatcher found it
                -- slow: a held snapshot keeps every dead entry it probes), the same from
                -- its 513 oldest rows however many wait: a sender with none among them
                -- waits for the next claim that walks.
                WITH keys AS (
                    SELECT DISTINCT k.key FROM unnest(v_set_tenants) AS k(key)
                ), ring AS (
                    SELECT k.key, row_number() OVER (
                               ORDER BY (v_cursor IS NOT NULL AND k.key <= v_cursor), k.key) AS n
                      FROM keys k
                )
                SELECT ARRAY(SELECT r.key FROM ring r WHERE r.n <= 64 ORDER BY r.n),
                       (SELECT r.key FROM ring r WHERE r.n = 64 AND EXISTS (
                            SELECT 1 FROM ring x WHERE x.n = 65))
                  INTO v_tenants, v_window_end;
                -- Each sender's candidates: its oldest rows among them.
                SELECT coalesce(array_agg(r.id ORDER BY r.id), '{}'),
                       coalesce(array_agg(r.key ORDER BY r.id), '{}'),
                       coalesce(array_agg(array_position(v_tenants, r.tenant) ORDER BY r.id), '{}'),
                       coalesce(array_agg(r.k ORDER BY r.id), '{}')
                  INTO v_cand_ids, v_cand_keys, v_cand_tis, v_cand_ks
                  FROM (SELECT s.id, s.key, s.tenant,
                               row_number() OVER (PARTITION BY s.tenant, s.key ORDER BY s.id) AS k
                          FROM unnest(v_set_ids, v_set_keys, v_set_tenants) AS s(id, key, tenant)) r
                 WHERE r.k <= v_cap AND r.tenant = ANY (v_tenants);
                v_single := (SELECT count(DISTINCT c.key) FROM unnest(v_cand_keys) AS c(key))
                            = (SELECT count(DISTINCT c.ti) FROM unnest(v_cand_tis) AS c(ti));
                -- The oldest: the set's first rows, or from a sweep, the head (read from
                -- the floor for just these slots).
                IF v_sw IS NULL THEN
                    v_oldest := v_set_ids[1 : v_fifo];
                ELSE
                    v_oldest := v_head;
                END IF;
            ELSE
                -- 1. The window of tenants, as schema 4's of senders; each probe gives
                -- the tenant's first sender too (the index's next entry). The probes
                -- cannot start at the floor (each is a range on the tenant), so a tenant
                -- whose rows at the stage are all claimed still costs its dead entries
                -- here; step 0 leaves this walk to stages with more waiting rows than the
                -- cap. The wrap's probe runs only when the first finds nothing.
                WITH RECURSIVE walk(key, first, n, wrapped) AS (
                    SELECT v_cursor, NULL::text, 0, false
                  UNION ALL
                    SELECT coalesce(a.key, b.key),
                           CASE WHEN a.key IS NOT NULL THEN a.first ELSE b.first END,
                           w.n + 1, w.wrapped OR a.key IS NULL
                      FROM walk w
                      LEFT JOIN LATERAL (
                          SELECT q.tenant_key AS key, q.sender_key AS first
                            FROM pepsi.workqueue q
                           WHERE q.stage = v_stage AND q.status = 'pending'
                             AND q.tenant_key > w.key
                           ORDER BY q.tenant_key, q.sender_key LIMIT 1
                      ) a ON true
                      LEFT JOIN LATERAL (
                          SELECT q.tenant_key AS key, q.sender_key AS first
                            FROM pepsi.workqueue q
                           WHERE a.key IS NULL AND NOT w.wrapped
                             AND q.stage = v_stage AND q.status = 'pending'
                           ORDER BY q.tenant_key, q.sender_key LIMIT 1
                      ) b ON true
                     WHERE w.n < 65 AND coalesce(a.key, b.key) IS NOT NULL
                       AND (NOT (w.wrapped OR a.key IS NULL) OR v_cursor IS NULL
                            OR coalesce(a.key, b.key) <= v_cursor)
                )
                SELECT ARRAY(SELECT w.key FROM walk w WHERE w.n BETWEEN 1 AND 64 ORDER BY w.n),
                       ARRAY(SELECT w.first FROM walk w WHERE w.n BETWEEN 1 AND 64 ORDER BY w.n),
                       (SELECT w.key FROM walk w WHERE w.n = 64 AND EXISTS (
                            SELECT 1 FROM walk x WHERE x.n = 65))
                  INTO v_tenants, v_tfirst, v_window_end;
                -- 2. Each tenant's senders: a walk of its senders from its own cursor
                -- (p_tcur_*), wrapping round, at most v_budget of them; one more probe
                -- tells whether more wait. One recursive statement for all the tenants:
                -- a row (i, key, n) is the n-th sender of the i-th tenant, n = 0 the
                -- start at its cursor; a tenant without one starts at its first sender
                -- (n = 1, from step 1), so a tenant of one sender costs one probe here;
                -- a probe runs only while n is within the budget.
                v_budget := greatest(1, 64 / greatest(cardinality(v_tenants), 1));
                v_tcurs := ARRAY(
                    SELECT (SELECT min(c.sender)
                              FROM unnest(p_tcur_stage, p_tcur_tenant, p_tcur_sender)
                                   AS c(stage, tenant, sender)
                             WHERE c.stage = v_stage AND c.tenant = t.key)
                      FROM unnest(v_tenants) WITH ORDINALITY AS t(key, n) ORDER BY t.n);
                WITH RECURSIVE walk(i, key, n, wrapped) AS (
                    SELECT 1, coalesce(v_tcurs[1], v_tfirst[1]),
                           CASE WHEN v_tcurs[1] IS NULL THEN 1 ELSE 0 END, v_tcurs[1] IS NULL
                     WHERE cardinality(v_tenants) > 0
                  UNION ALL
                    SELECT CASE WHEN g.go THEN w.i ELSE w.i + 1 END,
                           CASE WHEN g.go THEN nx.key
                                ELSE coalesce(v_tcurs[w.i + 1], v_tfirst[w.i + 1]) END,
                           CASE WHEN g.go THEN w.n + 1
                                WHEN v_tcurs[w.i + 1] IS NULL THEN 1 ELSE 0 END,
                           CASE WHEN g.go THEN nx.wrapped ELSE v_tcurs[w.i + 1] IS NULL END
                      FROM walk w
                     CROSS JOIN LATERAL (
                         SELECT CASE WHEN w.n <= v_budget THEN (
                                    SELECT q.sender_key FROM pepsi.workqueue q
                                     WHERE q.stage = v_stage AND q.status = 'pending'
                                       AND q.tenant_key = v_tenants[w.i]
                                       AND q.sender_key > w.key
                                     ORDER BY q.tenant_key, q.sender_key LIMIT 1) END AS key
                         OFFSET 0
                     ) a
                     CROSS JOIN LATERAL (
                         SELECT coalesce(a.key, CASE WHEN w.n <= v_budget AND NOT w.wrapped THEN (
                                    SELECT q.sender_key FROM pepsi.workqueue q
                                     WHERE q.stage = v_stage AND q.status = 'pending'
                                       AND q.tenant_key = v_tenants[w.i]
                                     ORDER BY q.tenant_key, q.sender_key LIMIT 1) END) AS key,
                                w.wrapped OR a.key IS NULL AS wrapped
                         OFFSET 0
                     ) nx
                     CROSS JOIN LATERAL (
                         SELECT w.n <= v_budget AND nx.key IS NOT NULL
                                AND (NOT nx.wrapped OR v_tcurs[w.i] IS NULL
                                     OR nx.key <= v_tcurs[w.i]) AS go
                     ) g
                     WHERE g.go OR w.i < cardinality(v_tenants)
                )
                SELECT coalesce(array_agg(w.i ORDER BY w.i, w.n), '{}'),
                       coalesce(array_agg(w.n ORDER BY w.i, w.n), '{}'),
                       coalesce(array_agg(w.key ORDER BY w.i, w.n), '{}')
                  INTO v_walk_i, v_walk_n, v_walk_keys
                  FROM walk w WHERE w.n >= 1;
                SELECT coalesce(array_agg(v_tenants[x.i] ORDER BY x.i, x.n), '{}'),
                       coalesce(array_agg(x.key ORDER BY x.i, x.n), '{}'),
                       coalesce(array_agg(x.i ORDER BY x.i, x.n), '{}')
                  INTO v_ws_tenants, v_ws_keys, v_ws_tis
                  FROM unnest(v_walk_i, v_walk_n, v_walk_keys) AS x(i, n, key)
                 WHERE x.n <= v_budget;
                -- Where each tenant's walk ended: its budget-th sender when one more
                -- waits (the next claim starts after it), else NULL when it had a
                -- cursor (start over). Tenants with neither are left out.
                SELECT v_tc_stage || coalesce(array_agg(v_stage ORDER BY t.n), '{}'),
                       v_tc_tenant || coalesce(array_agg(t.key ORDER BY t.n), '{}'),
                       v_tc_end || coalesce(array_agg(e.key ORDER BY t.n), '{}')
                  INTO v_tc_stage, v_tc_tenant, v_tc_end
                  FROM unnest(v_tenants) WITH ORDINALITY AS t(key, n)
                  LEFT JOIN LATERAL (
                      SELECT x.key FROM unnest(v_walk_i, v_walk_n, v_walk_keys) AS x(i, n, key)
                       WHERE x.i = t.n AND x.n = v_budget
                         AND EXISTS (SELECT 1 FROM unnest(v_walk_i, v_walk_n) AS y(i, n)
                                      WHERE y.i = t.n AND y.n = v_budget + 1)
                  ) e ON true
                 WHERE e.key IS NOT NULL OR v_tcurs[t.n] IS NOT NULL;
                -- 3. As in schema 4; each sender's candidates and the fifo start
                -- at the floor (the sender's range is inclusive, so the scan starts
                -- at (stage, tenant, sender, floor)).
                SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(s.key), '{}'),
                       coalesce(array_agg(s.ti), '{}'), coalesce(array_agg(c.k), '{}')
                  INTO v_cand_ids, v_cand_keys, v_cand_tis, v_cand_ks
                  FROM unnest(v_ws_tenants, v_ws_keys, v_ws_tis) AS s(tenant, key, ti)
                 CROSS JOIN LATERAL unnest(ARRAY(
                     SELECT q.workqueue_id FROM pepsi.workqueue q
                      WHERE q.stage = v_stage AND q.status = 'pending'
                        AND q.tenant_key = s.tenant
                        AND q.sender_key >= s.key AND q.sender_key <= s.key
                        AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                      ORDER BY q.tenant_key, q.sender_key, q.workqueue_id LIMIT v_cap
                 )) WITH ORDINALITY AS c(id, k);
                v_single := cardinality(v_ws_keys) = cardinality(v_tenants);
                IF v_sw IS NULL THEN
                    v_oldest := ARRAY(
                        SELECT q.workqueue_id FROM pepsi.workqueue q
                         WHERE q.stage >= v_stage AND q.stage <= v_stage
                           AND q.status = 'pending'
                           AND q.workqueue_id >= coalesce(v_lo, -9223372036854775808)
                         ORDER BY q.stage, q.workqueue_id LIMIT v_fifo);
                ELSE
                    v_oldest := v_head;
                END IF;
            END IF;
            v_ends := v_ends || v_window_end;

            -- 4. The order: the oldest first, then the candidates. Within a tenant, by
            -- its sender's lead + k × the average / the sender's weight (the k-th
            -- oldest of its sender), which numbers them j = 0, 1, … in the tenant;
            -- across tenants by the tenant's lead + j × the average / its weight. A
            -- tenant or sender without a known lead is level with the least-served
            -- known one (of the tenants; of its tenant's senders), 0 when none is.
            -- Joins of the candidates with small sets are left to hashing or avoided:
            -- a candidate names its tenant by its place in v_tenants, whose known leads
            -- and weights are read into arrays in that order first, and each level's
            -- least known lead is an aggregate or a window over the candidates.
            SELECT array_agg(k.us ORDER BY t.n),
                   array_agg(CASE WHEN k.w >= 0.01 AND k.w <= 100 THEN k.w ELSE 1 END
                             ORDER BY t.n),
                   min(k.us),
                   array_agg(greatest(coalesce(
                       (SELECT min(a.n)
                          FROM unnest(p_allow_stage, p_allow_tenant, p_allow_n)
                               AS a(stage, tenant, n)
                         WHERE a.stage = v_stage AND a.tenant = t.key),
                       p_allow_default[i], v_cap), 0) ORDER BY t.n)
              INTO v_tl_lead, v_tl_w, v_tl_least, v_tl_allow
              FROM unnest(v_tenants) WITH ORDINALITY AS t(key, n)
              LEFT JOIN (
                  SELECT l.tenant, min(l.us) AS us, min(l.w) AS w
                    FROM unnest(p_tlead_stage, p_tlead_tenant, p_tlead_us, p_tlead_w)
                         AS l(stage, tenant, us, w)
                   WHERE l.stage = v_stage AND l.us IS NOT NULL
                   GROUP BY l.tenant
              ) k ON k.tenant = t.key;
            IF v_single THEN
                -- One sender per tenant of the window (the common case): within a
                -- tenant the order is its sender's, the k-th oldest row is its j-th,
                -- and the senders' leads and weights change nothing.
                SELECT ARRAY(SELECT o.id FROM unnest(v_oldest) AS o(id) ORDER BY o.id)
                       || ARRAY(SELECT c.id
                                  FROM unnest(v_cand_ids, v_cand_tis, v_cand_ks) AS c(id, ti, k)
                                 WHERE c.id <> ALL (v_oldest)
                                   AND c.k <= least(v_cap, v_tl_allow[c.ti])
                                 ORDER BY coalesce(v_tl_lead[c.ti], v_tl_least - v_avg / 2, 0)
                                          + (c.k - 1) * v_avg / v_tl_w[c.ti], c.id)
                  INTO v_order;
            ELSE
                WITH known AS (
                    SELECT l.sender, min(l.us) AS us, min(l.w) AS w
                      FROM unnest(p_lead_stage, p_lead_sender, p_lead_us, p_lead_w)
                           AS l(stage, sender, us, w)
                     WHERE l.stage = v_stage AND l.us IS NOT NULL
                     GROUP BY l.sender
                ), cands AS (
                    SELECT c.id, c.ti, c.k, k.us,
                           CASE WHEN k.w >= 0.01 AND k.w <= 100 THEN k.w ELSE 1 END AS w
                      FROM unnest(v_cand_ids, v_cand_keys, v_cand_tis, v_cand_ks)
                           AS c(id, key, ti, k)
                      LEFT JOIN known k ON k.sender = c.key
                     WHERE c.id <> ALL (v_oldest)
                ), ranked AS (
                    SELECT c.id, c.ti,
                           row_number() OVER (
                               PARTITION BY c.ti
                               ORDER BY coalesce(c.us, c.least - v_avg / 2, 0)
                                        + (c.k - 1) * v_avg / c.w, c.id) AS j
                      FROM (SELECT c.*, min(c.us) OVER (PARTITION BY c.ti) AS least
                              FROM cands c) c
                )
                SELECT ARRAY(SELECT o.id FROM unnest(v_oldest) AS o(id) ORDER BY o.id)
                       || ARRAY(SELECT r.id
                                  FROM ranked r
                                 WHERE r.j <= least(v_cap, v_tl_allow[r.ti])
                                 ORDER BY coalesce(v_tl_lead[r.ti], v_tl_least - v_avg / 2, 0)
                                          + (r.j - 1) * v_avg / v_tl_w[r.ti], r.id)
                  INTO v_order;
            END IF;
        END IF;

        -- 5. The lock, as in schema 4.
        v_got := '{}';
        v_pos := 0;
        WHILE cardinality(v_got) < v_cap AND v_pos < cardinality(v_order) LOOP
            v_try := v_order[v_pos + 1 : v_pos + v_cap - cardinality(v_got)];
            v_pos := v_pos + cardinality(v_try);
            v_got := v_got || ARRAY(
                SELECT q.workqueue_id FROM pepsi.workqueue q
                 WHERE q.workqueue_id = ANY (v_try)
                   AND q.stage = v_stage AND q.status::text = 'pending'
                   FOR NO KEY UPDATE SKIP LOCKED);
        END LOOP;
        v_locked := v_locked || v_got;

        -- The next floor: every pending row of the stage from the floor up to the
        -- lowest row of step 0 not claimed was claimed now (step 0 read them in id
        -- order), so the next claim may start there; when step 0's rows were all
        -- claimed, just past the highest; when it read none, where it started. From a
        -- sweep, the set's rows read from the floor after the wrap (all of the set
        -- when it holds fewer than 513: every pending row from the floor) were read
        -- in id order too, and the higher of the two holds.
        v_floor_part := CASE WHEN cardinality(v_set_ids) < 513 THEN v_set_ids
                             ELSE v_set_ids[v_part + 1 :] END;
        v_next := v_next || greatest(
            coalesce(
                (SELECT min(h.id) FROM unnest(v_head) AS h(id) WHERE h.id <> ALL (v_got)),
                (SELECT max(h.id) + 1 FROM unnest(v_head) AS h(id)),
                v_lo),
            CASE WHEN v_sw IS NOT NULL THEN coalesce(
                (SELECT min(w.id) FROM unnest(v_floor_part) AS w(id) WHERE w.id <> ALL (v_got)),
                (SELECT max(w.id) + 1 FROM unnest(v_floor_part) AS w(id))) END);
        -- The next sweep: just past the last row of the set, in its order, that was
        -- claimed now (the set's rows before it that were left wait for the oldest
        -- rows' slots or the sweep's next round); the sweep unmoved when nothing of
        -- the set was claimed or the senders were walked; none when the stage had no
        -- set or all of it fitted.
        IF v_set_ids IS NULL OR cardinality(v_set_ids) <= least(v_cap, 64) THEN
            v_sweep_next := v_sweep_next || NULL::int8;
        ELSE
            v_set_pos := (SELECT max(s.n) FROM unnest(v_set_ids) WITH ORDINALITY AS s(id, n)
                           WHERE s.id = ANY (v_got));
            v_sweep_next := v_sweep_next || CASE
                WHEN v_set_pos IS NULL OR (cardinality(v_set_ids) > 512
                                           AND coalesce(p_walk[i], true))
                THEN v_sw
                ELSE v_set_ids[v_set_pos] + 1 END;
        END IF;
    END LOOP;

    -- The claimed rows with their tenants, a row per stage, a row per tenant whose
    -- senders' walk ended early or had a cursor.
    RETURN QUERY
    WITH claimed AS (SELECT * FROM pepsi.workqueue_take(v_locked, p_max_hops))
    SELECT c.workqueue_id, c.stage, c.sender_key, c.claim, v_due, c.looped, NULL::text,
           NULL::bigint, NULL::bigint, c.tenant_key
      FROM claimed c
    UNION ALL
    SELECT NULL::bigint, e.stage, NULL::text, NULL::bigint, v_due, NULL::boolean,
           e.window_end, e.next_floor, e.next_sweep, NULL::text
      FROM unnest(p_stages, v_ends, v_next, v_sweep_next)
           AS e(stage, window_end, next_floor, next_sweep)
    UNION ALL
    SELECT NULL::bigint, t.stage, NULL::text, NULL::bigint, v_due, NULL::boolean,
           t.window_end, NULL::bigint, NULL::bigint, t.tenant
      FROM unnest(v_tc_stage, v_tc_tenant, v_tc_end) AS t(stage, tenant, window_end)
    UNION ALL
    SELECT NULL::bigint, NULL::text, NULL::text, NULL::bigint, v_due, NULL::boolean,
           NULL::text, NULL::bigint, NULL::bigint, NULL::text
     WHERE v_n = 0;
END $$;


COMMENT ON FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[],
                                               text[], float8[], int4, int8[], boolean[],
                                               int8[], float8[], text[], text[], float8[],
                                               float8[], text[], text[], text[], int4[],
                                               text[], text[], int4[]) IS
    'The fair batched claim (SPEC §7): per stage, up to p_caps of pending rows with an id '
    'of at least p_floors (NULL: any), the p_fifo oldest first, the rest shared between '
    'a window of at most 64 tenants after p_cursor (tenant lead + j × p_avg_us / weight) '
    'and within each between its senders after its own cursor p_tcur_* (sender lead + k '
    '× p_avg_us / weight; found among the stage''s 513 oldest rows from the floor, or '
    'from p_sweeps wrapping round to the floor, where p_walk is false); claimed as '
    'running (or failed looped past p_max_hops) under one claim token. Returns the '
    'claimed rows with their tenant_key, then one row per stage with workqueue_id and '
    'tenant_key NULL, the window_end to use as the next tenant cursor (NULL: start '
    'over), the next floor and the next sweep, then one row per tenant whose senders'' '
    'walk stopped short (window_end: its next cursor) or had a cursor (window_end NULL: '
    'start over); every row carries the seconds until the earliest paused row is due. '
    'p_allow_*: per stage the most rows a tenant not listed may take (NULL: the cap), '
    'and per stage and tenant the most it may take now (a rate''s allowance).';

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_dispatch', 'EXECUTE', 'FUNCTION pepsi.workqueue_claim_fair(text[], int4[], int4[], float8[], text[], text[], text[], float8[], int4, int8[], boolean[], int8[], float8[], text[], text[], float8[], float8[], text[], text[], text[], int4[], text[], text[], int4[])'),
    ('pepsi_dispatch', 'SELECT (workqueue_id, stage, status, timeout, sender_key, claim, tenant_key)',
     'TABLE pepsi.workqueue'),
    ('pepsi_dispatch', 'SELECT', 'TABLE pepsi.fair_weights'),
    ('pepsi_dispatch', 'SELECT', 'TABLE pepsi.tenant_shares'),
    ('pepsi_dispatch', 'INSERT', 'TABLE pepsi.tenant_shares'),
    ('pepsi_dispatch', 'UPDATE', 'TABLE pepsi.tenant_shares'),
    ('pepsi_dispatch', 'DELETE', 'TABLE pepsi.tenant_shares'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.tenant_shares'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.tenants'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.tenant_rule'),
    ('pepsi_admin', 'INSERT', 'TABLE pepsi.tenants'),
    ('pepsi_admin', 'UPDATE', 'TABLE pepsi.tenants'),
    ('pepsi_admin', 'DELETE', 'TABLE pepsi.tenants'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.fair_weights'),
    ('pepsi_admin', 'INSERT', 'TABLE pepsi.fair_weights'),
    ('pepsi_admin', 'UPDATE', 'TABLE pepsi.fair_weights'),
    ('pepsi_admin', 'DELETE', 'TABLE pepsi.fair_weights'),
    ('pepsi_admin', 'EXECUTE', 'FUNCTION pepsi.tenant_of(text)');
