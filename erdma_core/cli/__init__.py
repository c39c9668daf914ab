"""The ``erdma`` command line: ``erdma run`` (launcher), ``erdma bench`` (bench), plugins, doctor, config."""
