-- One block of page views from the event intake's stage table (pos/id come from the intake),
-- with the browser the collector's user agent parsing found.
SELECT pv.pos, pv.id, pv._timestamp AS viewed_at, pv.url, pv.customer_id,
       pv.eventn_ctx_parsed_ua_ua_family AS browser, pv.api_key AS token
FROM block pv
