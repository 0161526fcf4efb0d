"""What the tests and the benchmarks share, and what a user's own tests may use: an S3-compatible
server on loopback (``object_store``: moto, as s3fs's own tests use it) and one corpus written
in every format the service reads (``format_corpus``). The demo corpus lives with the demo
(``service/demo.py``). Nothing here is imported by the service, the workers or the trainers."""
