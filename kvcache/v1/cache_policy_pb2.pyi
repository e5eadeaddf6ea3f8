from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class CachePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_POLICY_UNSPECIFIED: _ClassVar[CachePolicy]
    CACHE_POLICY_STORE: _ClassVar[CachePolicy]
    CACHE_POLICY_READ_ONLY: _ClassVar[CachePolicy]
    CACHE_POLICY_NONE: _ClassVar[CachePolicy]
CACHE_POLICY_UNSPECIFIED: CachePolicy
CACHE_POLICY_STORE: CachePolicy
CACHE_POLICY_READ_ONLY: CachePolicy
CACHE_POLICY_NONE: CachePolicy
