"""DMI's training integration: --dmi-* arguments, activation inside pretrain, step context,
checkpoint state, the log line, and the CPU development mode."""

# The flag that runs a (tiny) model on a machine without a GPU; here so that the launcher (which
# must load nothing else of DMI without a DMI flag) and the entry share it without importing each other.
CPU_DEV_FLAG = "--cpu-dev-mode"
