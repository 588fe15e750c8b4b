-- Schema version 8: pepsi.sender_key in PL/pgSQL, with the same result for every input.
--
-- The generated column workqueue.sender_key calls it. As an inlinable SQL function its
-- body (and pepsi.address_domain's) was read back from the catalog and planned again
-- at the start of every INSERT and UPDATE of pepsi.workqueue, PostgreSQL recomputing
-- stored generated columns on every UPDATE: a fifth of the server's CPU under a
-- claim-and-advance load. A PL/pgSQL function is compiled once per session and its
-- expression planned once; a call per row costs a few microseconds.
--
-- The built-in functions are schema-qualified: the key is computed inside the
-- SECURITY DEFINER functions that insert rows, whatever the caller's search_path.
CREATE OR REPLACE FUNCTION pepsi.sender_key(auth_user text, client_ip inet, mail_from text,
                                            rcpt_to text[])
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN CASE
        WHEN nullif(auth_user, '') IS NOT NULL
            THEN 'user:' || pg_catalog.lower(auth_user)
        -- An IPv4 client seen by a dual-stack listener (::ffff:a.b.c.d) is that IPv4 peer.
        WHEN client_ip <<= inet '::ffff:0.0.0.0/96'
            THEN 'ip:' || pg_catalog.host(inet '0.0.0.0' + (client_ip - inet '::ffff:0.0.0.0'))
        WHEN client_ip IS NOT NULL AND pg_catalog.family(client_ip) = 6
            THEN 'ip:' || pg_catalog.text(pg_catalog.network(pg_catalog.set_masklen(client_ip, 64)))
        WHEN client_ip IS NOT NULL THEN 'ip:' || pg_catalog.host(client_ip)
        WHEN mail_from = '' THEN 'null:' || coalesce(pepsi.address_domain(rcpt_to[1]), '')
        ELSE 'from:' || pepsi.address_domain(mail_from)
    END;
END $$;
