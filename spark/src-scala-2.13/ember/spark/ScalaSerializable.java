package ember.spark;

/**
 * Serializable as Spark asks; in Scala 2.13 {@code scala.Serializable} is
 * {@code java.io.Serializable}.  See src-scala-2.12 for why this exists.
 */
interface ScalaSerializable extends java.io.Serializable {}
