-- Pepsi schema, version 21: the destinations of relay-to-internet (SPEC §22) — how
-- many connections each has open across every worker of every stage, and which are
-- in trouble.
--
-- Connections: a worker that opens a connection to a destination (a recipient domain)
-- first takes one of its DESTINATION_CONCURRENCY slots, a session-level advisory lock
-- (class 1885696115, 'peps'; key hashtext(destination || '/' || slot)), and gives it
-- back when the connection closes; a worker that dies gives its slots back with its
-- session. No row is written for it.
--
-- Trouble: a row of pepsi.destinations exists only for a destination whose last
-- connection attempts failed. Each failure adds one; at DEAD_AFTER the destination is
-- suspended for DEAD_TIME (suspended_until), and every worker leaves it alone until
-- then (its messages wait, without a connection and without a strike); the next
-- failure after that suspends it again at once. An exchanger that answers for a
-- recipient deletes the row. pepsi-queue lists the rows and lifts a suspension (deleting the row).
--
-- Workers write only through the functions below (SECURITY DEFINER, checked values);
-- they cannot read or write the table otherwise.

CREATE TABLE pepsi.destinations (
    destination text PRIMARY KEY
        CHECK (destination ~ '^[a-z0-9._:\[\]-]{1,255}$'),
    failures integer NOT NULL DEFAULT 0 CHECK (failures >= 0),
    suspended_until timestamptz,
    reason text NOT NULL DEFAULT '' CHECK (length(reason) <= 1000),
    updated timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE pepsi.destinations IS
    'relay-to-internet''s destinations in trouble: consecutive connection failures and '
    'the suspension they caused; a row goes when a connection succeeds or an operator '
    'lifts it (pepsi-queue destinations lift).';
COMMENT ON INDEX pepsi.destinations_pkey IS 'One row per destination.';
COMMENT ON COLUMN pepsi.destinations.destination IS
    'The destination: a recipient domain in lower case, or an address literal.';
COMMENT ON COLUMN pepsi.destinations.failures IS
    'Connection attempts (or "try again later" replies) failed in a row.';
COMMENT ON COLUMN pepsi.destinations.suspended_until IS
    'Until when no worker connects to it; NULL: not suspended.';
COMMENT ON COLUMN pepsi.destinations.reason IS 'The last failure, as a worker saw it.';
COMMENT ON COLUMN pepsi.destinations.updated IS 'When the last failure was counted.';

-- Takes a connection slot of p_destination: the first free one of p_limit, from
-- p_start on (a random start spreads the workers). Answers the slot taken (NULL when
-- all are taken or the destination is suspended), the suspension's end, and the
-- failures counted so far (a worker that connects after failures deletes the row).
CREATE FUNCTION pepsi.destination_open(p_destination text, p_limit integer, p_start integer)
RETURNS TABLE (slot integer, suspended_until timestamptz, failures integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_until timestamptz;
    v_failures integer;
    v_limit integer := least(greatest(coalesce(p_limit, 1), 1), 10000);
    v_slot integer;
BEGIN
    SELECT d.suspended_until, d.failures INTO v_until, v_failures
      FROM pepsi.destinations d
     WHERE d.destination = p_destination;
    v_failures := coalesce(v_failures, 0);
    IF v_until > now() THEN
        RETURN QUERY SELECT NULL::integer, v_until, v_failures;
        RETURN;
    END IF;
    FOR i IN 0 .. v_limit - 1 LOOP
        v_slot := (abs(coalesce(p_start, 0) % v_limit) + i) % v_limit;
        IF pg_try_advisory_lock(1885696115, hashtext(p_destination || '/' || v_slot)) THEN
            RETURN QUERY SELECT v_slot, NULL::timestamptz, v_failures;
            RETURN;
        END IF;
    END LOOP;
    RETURN QUERY SELECT NULL::integer, NULL::timestamptz, v_failures;
END $$;

COMMENT ON FUNCTION pepsi.destination_open(text, integer, integer) IS
    'Takes one of the destination''s connection slots (a session advisory lock), unless '
    'it is suspended: the slot (NULL: none free or suspended), the suspension''s end, '
    'the failures counted.';

-- Moves a kept connection from one destination to another (relay-to-internet shares
-- a connection to an exchanger address among destinations): takes a slot of
-- p_destination as pepsi.destination_open does and, when it got one, gives p_from's
-- slot p_from_slot back, in one round trip. Answers as pepsi.destination_open.
CREATE FUNCTION pepsi.destination_move(
    p_from text, p_from_slot integer, p_destination text, p_limit integer, p_start integer)
RETURNS TABLE (slot integer, suspended_until timestamptz, failures integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_row record;
BEGIN
    SELECT * INTO v_row FROM pepsi.destination_open(p_destination, p_limit, p_start) o;
    IF v_row.slot IS NOT NULL THEN
        PERFORM pg_advisory_unlock(1885696115, hashtext(p_from || '/' || p_from_slot));
    END IF;
    RETURN QUERY SELECT v_row.slot, v_row.suspended_until, v_row.failures;
END $$;

COMMENT ON FUNCTION pepsi.destination_move(text, integer, text, integer, integer) IS
    'Takes a slot of a destination for a kept connection and, when it got one, gives '
    'back the slot the connection held for another destination.';

-- Gives a slot back (the connection closed).
CREATE FUNCTION pepsi.destination_close(p_destination text, p_slot integer)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT pg_advisory_unlock(1885696115, hashtext(p_destination || '/' || p_slot));
$$;

COMMENT ON FUNCTION pepsi.destination_close(text, integer) IS
    'Gives back a connection slot pepsi.destination_open took in this session.';

-- Counts a failed connection attempt (or a "try again later" reply) of p_destination;
-- at p_dead_after failures in a row (1 to 1000) it is suspended for p_dead_time (1 s
-- to 1 day). Answers the suspension's end, NULL when not suspended.
CREATE FUNCTION pepsi.destination_failed(
    p_destination text, p_reason text, p_dead_after integer, p_dead_time interval)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_failures integer;
    v_until timestamptz;
    v_time interval := least(greatest(coalesce(p_dead_time, interval '300 s'), interval '1 s'),
                             interval '1 day');
BEGIN
    INSERT INTO pepsi.destinations AS d (destination, failures, reason, updated)
    VALUES (p_destination, 1, left(coalesce(p_reason, ''), 1000), now())
    ON CONFLICT (destination) DO UPDATE
       SET failures = least(d.failures, 1000000) + 1,
           reason = EXCLUDED.reason,
           updated = now()
    RETURNING d.failures, d.suspended_until INTO v_failures, v_until;
    IF v_failures >= least(greatest(coalesce(p_dead_after, 1), 1), 1000)
       AND (v_until IS NULL OR v_until <= now()) THEN
        v_until := now() + v_time;
        UPDATE pepsi.destinations d SET suspended_until = v_until
         WHERE d.destination = p_destination;
    END IF;
    RETURN CASE WHEN v_until > now() THEN v_until END;
END $$;

COMMENT ON FUNCTION pepsi.destination_failed(text, text, integer, interval) IS
    'Counts a failed connection to the destination and suspends it at the given count: '
    'the suspension''s end, or NULL.';

-- A connection to p_destination succeeded: it is in trouble no more.
CREATE FUNCTION pepsi.destination_succeeded(p_destination text)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM pepsi.destinations WHERE destination = p_destination;
$$;

COMMENT ON FUNCTION pepsi.destination_succeeded(text) IS
    'Forgets the destination''s failures: a connection to it succeeded.';

INSERT INTO pepsi.role_grants (role, privilege, object) VALUES
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.destination_open(text, integer, integer)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.destination_close(text, integer)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.destination_move(text, integer, text, integer, integer)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.destination_failed(text, text, integer, interval)'),
    ('pepsi_worker', 'EXECUTE', 'FUNCTION pepsi.destination_succeeded(text)'),
    ('pepsi_admin', 'SELECT', 'TABLE pepsi.destinations'),
    ('pepsi_admin', 'DELETE', 'TABLE pepsi.destinations');
