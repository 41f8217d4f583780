"""DMI's training integration: --dmi-* arguments, activation inside pretrain, step context,
checkpoint state, the log line, and the CPU development mode."""
