"""protoc output for proto/podresources/v1/api.proto; see proto/generate.py."""
