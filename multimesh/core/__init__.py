"""Pure sharding logic: rules, placements, annotations, layouts, meshes, schedules. No step is traced here."""
