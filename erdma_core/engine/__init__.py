"""The collective engine: the op table, schedules run over a transport, reductions, dtypes, compression."""
