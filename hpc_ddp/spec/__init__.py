"""What the user asked for (pure): flags, job files and profiles merged into one frozen, validated JobSpec."""
