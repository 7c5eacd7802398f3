"""Pure sharding logic: rules, placements, annotations, layouts, meshes, the sharding report, transfers between
meshes and processes, and who of a run's processes is alive. No step is traced here (schedules live in
`multimesh.schedules`)."""
