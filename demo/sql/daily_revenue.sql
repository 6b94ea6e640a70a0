SELECT CAST(pos AS DATE) AS day, coalesce(country, 'unknown') AS country,
       count(DISTINCT order_id) AS orders, sum(amount) AS revenue
FROM block
GROUP BY 1, 2
