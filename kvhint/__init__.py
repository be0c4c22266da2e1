"""Generated kvhint.v1 protocol bindings (see tools/gen_proto.py). Do not edit."""
