"""protoc output for proto/deviceplugin/v1beta1/api.proto; see proto/generate.py."""
