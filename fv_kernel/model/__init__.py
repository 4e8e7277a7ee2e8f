"""Cards made resident: instances, request validation against them, pre-flight and build checks,
and the catalog of cards the enabled plugins contribute."""
