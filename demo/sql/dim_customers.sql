-- Newest version of each customer (stage.customers holds one row per change).
SELECT customer_id, name, country, segment, pos AS updated_at
FROM (
  SELECT *, row_number() OVER (PARTITION BY customer_id ORDER BY pos DESC, id DESC) AS rn
  FROM block
)
WHERE rn = 1
