"""What keeps one caller from harming the others: the requests in flight (concurrency, `Abort`),
the HTTP protocol's timeouts for slow and idle connections, and giving large inputs' memory back
to the system (`heap_trim`).
"""
