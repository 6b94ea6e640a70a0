-- One block of orders, enriched from the customer dimension.
SELECT o.pos, o.id, o.order_id, o.customer_id, o.status,
       c.country, c.segment
FROM block o
LEFT JOIN dim.customers c ON c.customer_id = o.customer_id
