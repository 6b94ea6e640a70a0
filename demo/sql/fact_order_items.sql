-- One block of order lines with the order's customer attributes.
SELECT i.pos, i.id, i.order_id, i.sku, i.qty, i.price,
       CAST(i.qty * i.price AS DECIMAL(18, 2)) AS amount,
       o.customer_id, o.country
FROM block i
LEFT JOIN fact.orders o ON o.order_id = i.order_id
