package ember.spark;

/**
 * Serializable as Scala 2.12's Spark asks: {@code CoalescedRDD} requires its
 * coalescer to be a {@code scala.Serializable}, which Scala 2.13 made an alias
 * of {@code java.io.Serializable} and no longer ships as a class.  setup.py
 * compiles the {@code src-scala-*} directory of the Scala version it compiles
 * against.
 */
interface ScalaSerializable extends scala.Serializable {}
