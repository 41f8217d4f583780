"""The store: what DMI's data is and where it lives, shared by the sinks (which write) and the
reader (which reads).

- ``schema``: the tables and their DDL, the schema version.
- ``backend``: the embedded chDB store and a ClickHouse server behind one interface.
- ``segments`` and ``raw_segment``: the spool's segment formats: finding, reading and verifying
  segments (the sinks' ``SpoolWriter`` writes them).
- ``ingest``: loading spool segments into a backend (verified, read back, then recorded).

How a store is addressed (server URL, database name, password) is ``megatron.core.dmi.store_address``,
below this package, so the configuration checks its values without importing it.
"""
