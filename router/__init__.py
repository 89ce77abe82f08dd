"""The router: gateway, KV index, load tracking, cost function, disaggregation decision, retries and migration."""
